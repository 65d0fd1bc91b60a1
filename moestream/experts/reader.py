"""Reader: positioned reads of whole experts into page-aligned, recycled buffers from a thread pool.

Owns the read plan of an expert (its parts sorted by file offset, neighbours coalesced across small holes, every
range widened to 4 KiB so O_DIRECT accepts it), the open file descriptors (O_DIRECT where the filesystem allows,
else buffered reads followed by POSIX_FADV_DONTNEED so expert bytes never stay in the page cache), the order in
which queued reads reach the disk (a priority queue: reads a step waits on before read-ahead, first queued first
within a priority, so experts land one after another and compute can start on the first while the rest are
read; read-ahead not yet started can be cancelled or promoted), the pool of buffers recycled from evicted
experts, and I/O timing. It does not decide what to read (dispatch, prefetch) or what stays resident (cache).
"""
from __future__ import annotations

import heapq
import itertools
import mmap
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from moestream.errors import CheckpointError
from moestream.weights.index import ALIGN, drop_pages, pread_fill

GAP = 4096  # read through holes up to this size rather than issue a second request
SMALL = 64  # buffered runs are packed at this alignment (cache line; every dtype's alignment)
DIRECT_MIN = 32 * 1024  # runs below this are read buffered: widening them to 4 KiB would waste RAM
DEMAND, AHEAD = 0, 1  # read priorities: what a step waits on, then read-ahead for later steps
# Reads in flight. Two kept this disk as busy as eight (it gives the same bandwidth at any depth) and land experts
# one after another, so compute starts on the first while the next is read; with eight, a layer's reads all
# finished together at the end (docs/performance.md). A large expert is one large request, which the kernel
# splits across the device's queue anyway.
IO_THREADS = 2
# Reads in flight during a scan (a step that needs most experts of every layer): order matters less there and a
# deeper queue got more out of this virtual disk (3 MiB direct reads, 2 vs 8 in flight: 0.56-0.67 vs 0.63-0.85 GB/s
# in alternated runs under load, docs/performance.md "Batch throughput").
SCAN_DEPTH = 4
COALESCE_MAX = 64 << 20  # most bytes one coalesced request of a remote file carries


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset + nbytes) of `file` that belong in the buffer at `dst`."""

    file: Path
    offset: int
    nbytes: int
    dst: int = 0


@dataclass(frozen=True)
class Run:
    """One read request: [start, start + length) of `file` into the buffer at `dst`. Direct runs are 4 KiB
    aligned in file and buffer; buffered runs are exact and their pages are dropped after the read."""

    file: Path
    start: int
    length: int
    dst: int
    direct: bool = True


@dataclass(frozen=True)
class ReadPlan:
    runs: tuple[Run, ...]
    starts: tuple[int, ...]  # where each input span's first byte lands in the buffer, in input order
    nbytes: int  # buffer size: what the expert costs resident, alignment and read-through holes included


def group_extents(extents: Sequence[tuple[Path, int, int]], gap: int) -> list[list[int]]:
    """Indices of (file, offset, nbytes) extents grouped into runs one read can cover: same file, in offset order,
    not overlapping, holes of at most `gap` bytes between neighbours."""
    order = sorted(range(len(extents)), key=lambda i: (str(extents[i][0]), extents[i][1]))
    groups: list[list[int]] = []
    for i in order:
        file, offset, _ = extents[i]
        if groups:
            last_file, last_offset, last_nbytes = extents[groups[-1][-1]]
            if last_file == file and last_offset + last_nbytes <= offset <= last_offset + last_nbytes + gap:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


def plan_reads(spans: Sequence[Span], gap: int = GAP) -> ReadPlan:
    """Coalesce spans (any order, any files) into aligned runs; spans closer than `gap` share one run."""
    groups = group_extents([(s.file, s.offset, s.nbytes) for s in spans], gap)
    runs: list[Run] = []
    starts = [0] * len(spans)
    # large runs first, 4 KiB aligned (O_DIRECT); small ones after them, packed exactly (buffered)
    big = [g for g in groups if _extent(spans, g)[1] - _extent(spans, g)[0] >= DIRECT_MIN]
    small = [g for g in groups if g not in big]
    dst = 0
    for g in big:
        lo, hi = _extent(spans, g)
        start, end = align_down(lo), align_up(hi)
        runs.append(Run(spans[g[0]].file, start, end - start, dst, True))
        for i in g:
            starts[i] = dst + spans[i].offset - start
        dst += end - start
    for g in small:
        lo, hi = _extent(spans, g)
        runs.append(Run(spans[g[0]].file, lo, hi - lo, dst, False))
        for i in g:
            starts[i] = dst + spans[i].offset - lo
        dst += -(-(hi - lo) // SMALL) * SMALL
    return ReadPlan(tuple(runs), tuple(starts), dst)


def _extent(spans: Sequence[Span], group: list[int]) -> tuple[int, int]:
    return spans[group[0]].offset, spans[group[-1]].offset + spans[group[-1]].nbytes


@dataclass
class IOStats:
    bytes_read: int = 0  # bytes transferred from storage (aligned runs)
    requests: int = 0  # runs read (one per contiguous range; a packed expert is one)
    preads: int = 0  # preadv system calls issued for them (more than requests only on short reads)
    busy_s: float = 0.0  # wall time with at least one read in flight
    direct_files: int = 0
    buffered_files: int = 0


class BufferPool:
    """Page-aligned anonymous buffers, recycled by size. Idle buffers are trimmed so they never outlive a step, and
    a new buffer is only mapped after idle ones of other sizes (experts' spans differ by alignment pages) are
    dropped to make room for it: idle memory, which the budget does not count, never piles up within a step.

    A buffer given back may carry `kept`: what its last user built over it (the store's zero-copy part views) and
    may use again over the same memory; `take` hands it on to `claim` with the buffer, and it lives and dies with
    the buffer (dropped with it, never stored on it: views hold their buffer, so a reference back would make a
    cycle only the cycle collector frees)."""

    def __init__(self) -> None:
        self._free: dict[int, list[tuple[mmap.mmap, object]]] = {}
        self._kept: dict[int, tuple[mmap.mmap, object]] = {}  # id(buf) -> (buf, kept): taken, not yet claimed
        self._lock = threading.Lock()
        self.idle_bytes = 0
        self.mapped_bytes = 0  # bytes of buffers mapped afresh (each page faults in on its read), not recycled

    def take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.idle_bytes -= nbytes
                buf, kept = free.pop()
                if kept is not None:
                    self._kept[id(buf)] = (buf, kept)
                return buf
            self._drop(nbytes)
            self.mapped_bytes += nbytes
        # private: MAP_SHARED anonymous memory would be shmem, charged and reclaimed differently
        return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def claim(self, buf: object) -> object:
        """What the buffer's last user kept over it (`give(buf, kept)`), or None; once per `take`."""
        with self._lock:
            got = self._kept.pop(id(buf), None)
        return got[1] if got is not None and got[0] is buf else None

    def give(self, buf: object, kept: object = None) -> None:
        if not isinstance(buf, mmap.mmap):
            return
        with self._lock:
            stale = self._kept.pop(id(buf), None)  # taken and given back unclaimed (a cancelled or failed read)
            if kept is None and stale is not None and stale[0] is buf:
                kept = stale[1]
            self._free.setdefault(len(buf), []).append((buf, kept))
            self.idle_bytes += len(buf)

    def trim(self, keep_bytes: int = 0) -> None:
        """Drop idle buffers beyond `keep_bytes` (their memory returns to the OS when the last view dies)."""
        with self._lock:
            if self.idle_bytes > keep_bytes:  # called after every layer and state growth: mostly nothing to drop
                self._drop(self.idle_bytes - keep_bytes)

    def _drop(self, nbytes: int) -> None:
        """Release at least `nbytes` of idle buffers (or all of them), largest first. Caller holds the lock."""
        freed = 0
        for size in sorted(self._free, reverse=True):
            lst = self._free[size]
            while lst and freed < nbytes:
                lst.pop()
                self.idle_bytes -= size
                freed += size
        self._free = {k: v for k, v in self._free.items() if v}


class _Job:
    """One submitted plan: its runs are taken by the I/O threads in order; the future resolves after the last."""

    __slots__ = ("plan", "buf", "future", "then", "next", "left", "calls", "error")

    def __init__(self, plan: ReadPlan, buf: mmap.mmap, then: Callable | None):
        self.plan, self.buf, self.then, self.future = plan, buf, then, Future()
        self.next = 0  # index of the next run to start
        self.left = len(plan.runs)  # runs not finished
        self.calls = 0
        self.error: BaseException | None = None


def _detach(job: _Job) -> None:
    """A finished or cancelled job lets go of its buffer and its future (which pointed back at it): the buffer's
    memory must be freed when its last user drops it, not when the cycle collector next runs."""
    job.future.__dict__.pop("moestream_job", None)
    job.buf = job.then = job.future = None  # type: ignore[assignment]


class Reader:
    """Positioned reads into aligned buffers on `threads` I/O threads (at most that many reads in flight), taken
    from a priority queue; `direct=False` forces buffered reads + page drop."""

    def __init__(self, threads: int = IO_THREADS, direct: bool = True):
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.threads = max(1, threads)
        self.pool = BufferPool()
        self.stats = IOStats()
        self._fds: dict[tuple[Path, bool], int] = {}
        self._no_direct: set[Path] = set()
        self._lock = threading.Lock()
        self._inflight = 0
        self._busy_since = 0.0
        self._queue: list[tuple[int, int, _Job]] = []  # (priority, order, job): one entry per run still to start
        self._order = itertools.count()
        self._cv = threading.Condition(threading.Lock())
        self._workers: list[threading.Thread] = []
        self._closed = False
        self.depth = self.threads  # reads in flight at most (set_depth raises it for scans)
        self.ahead_limit = max(1, self.threads - 1)  # threads read-ahead may occupy at once
        self._ahead_running = 0
        self._running = 0

    # ---- file descriptors ----------------------------------------------------------------------------
    def _fd(self, path: Path, direct: bool) -> int:
        key = (path, direct)
        fd = self._fds.get(key)
        if fd is None:
            with self._lock:
                fd = self._fds.get(key)
                if fd is None:
                    fd = self._fds[key] = self._open(path, direct)
        return fd

    def _open(self, path: Path, direct: bool) -> int:
        """An fd for `path`; with direct=True an OSError means 'no O_DIRECT here' and the caller falls back."""
        try:
            fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
        except OSError as e:
            if direct:
                raise
            raise CheckpointError(f"{path}: cannot open for reading: {e}") from None
        if direct:
            self.stats.direct_files += 1
        else:
            self.stats.buffered_files += 1
        return fd

    # ---- reads ----------------------------------------------------------------------------------------
    def _read_run(self, run: Run, view: memoryview) -> int:
        """Read one run; returns the number of preadv calls it took."""
        if not isinstance(run.file, Path):  # a remote shard: HTTP range requests through the SSD tier
            run.file.read_into(run.start, [view[:run.length]])
            return 1
        use_direct = self.direct and run.direct and isinstance(view.obj, mmap.mmap) and run.file not in self._no_direct
        if use_direct:
            try:
                return self._pread(self._fd(run.file, True), run, view, direct=True)
            except OSError:  # tmpfs and some network filesystems refuse O_DIRECT: buffered + page drop for good
                self._no_direct.add(run.file)
        return self._pread(self._fd(run.file, False), run, view, direct=False)

    @staticmethod
    def _pread(fd: int, run: Run, view: memoryview, direct: bool) -> int:
        # a short read is end of file: the aligned tail past EOF is padding, nothing owed
        _, calls = pread_fill(fd, [view[:run.length]], run.start)
        if not direct:
            drop_pages(fd, run.start, run.length)
        return calls

    def submit(self, plan: ReadPlan, priority: int = DEMAND, then: Callable | None = None) -> Future:
        """Queue `plan` for a recycled (or fresh) aligned buffer; the future yields the buffer, or `then(buffer)`
        computed on the I/O thread (which then owns the buffer if it raises). Lower `priority` is read first;
        within a priority, in submission order."""
        if not plan.runs:
            done: Future = Future()
            done.set_result(then(self.pool.take(plan.nbytes)) if then else self.pool.take(plan.nbytes))
            return done
        job = _Job(plan, self.pool.take(plan.nbytes), then)
        fut = job.future  # an I/O thread may finish (and detach) the job before this thread returns
        fut.moestream_job = job  # type: ignore[attr-defined]  # what cancel / promote act on
        with self._cv:
            if self._closed:
                raise RuntimeError("reader is closed")
            self._push(job, priority)
            self._spawn()
        return fut

    def set_depth(self, depth: int) -> None:
        """Keep at most `depth` reads in flight from now on (read-ahead never on the last of them)."""
        depth = max(1, depth)
        if depth == self.depth:
            return
        with self._cv:
            self.depth, self.ahead_limit = depth, max(1, depth - 1)
            self._cv.notify_all()

    def _spawn(self) -> None:
        """Caller holds _cv: enough I/O threads for `depth` reads in flight (idle ones wait on the queue)."""
        for i in range(len(self._workers), self.depth):
            t = threading.Thread(target=self._work, name=f"moestream-io-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def cancel(self, fut: Future) -> bool:
        """Withdraw a queued read none of whose runs has started: its buffer returns to the pool and the future
        is cancelled. False (nothing changes) once a run started, or for a future this reader did not make."""
        job = getattr(fut, "moestream_job", None)
        if job is None:
            return False
        with self._cv:
            if job.next > 0 or job.left == 0:
                return False
            job.next = len(job.plan.runs)  # its queue entries are skipped
            job.left = 0
        self.pool.give(job.buf)
        _detach(job)
        fut.cancel()
        return True

    def promote(self, fut: Future, priority: int = DEMAND) -> None:
        """Runs of `fut` not yet started are read at `priority` (stale entries at the old one are skipped)."""
        job = getattr(fut, "moestream_job", None)
        if job is not None:
            with self._cv:
                if job.next < len(job.plan.runs):
                    self._push(job, priority)

    def _push(self, job: _Job, priority: int) -> None:
        """Caller holds _cv: one queue entry per run still to start."""
        for _ in range(job.next, len(job.plan.runs)):
            heapq.heappush(self._queue, (priority, next(self._order), job))
        self._cv.notify(len(job.plan.runs) - job.next)

    def _blocked(self) -> bool:
        """Caller holds _cv: nothing to start now. Read-ahead never takes the last free thread, so a read that a
        step waits on starts at once instead of queueing behind a guess."""
        return not self._queue or self._running >= self.depth or \
            (self._queue[0][0] >= AHEAD and self._ahead_running >= self.ahead_limit)

    def _work(self) -> None:
        while True:
            with self._cv:
                while self._blocked() and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                prio, _, job = heapq.heappop(self._queue)
                if job.next >= len(job.plan.runs):
                    continue  # cancelled, or taken through an entry of another priority
                run = job.plan.runs[job.next]
                job.next += 1
                ahead = prio >= AHEAD
                self._ahead_running += ahead
                self._running += 1
                batch = [(job, run)] + (self._adjacent(run, prio) if not isinstance(run.file, Path) else [])
            self._begin()
            try:
                if len(batch) > 1:
                    calls = self._read_batch(batch)
                else:
                    calls = 0 if job.error else self._read_run(run, memoryview(job.buf)[run.dst:run.dst + run.length])
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                for j, _ in batch:
                    j.error = e
                calls = 0
            finally:
                self._end()
            done = []
            with self._cv:
                for j, _ in batch:
                    j.calls += calls
                    j.left -= 1
                    if j.left == 0:
                        done.append(j)
                self._running -= 1
                self._ahead_running -= ahead
                self._cv.notify()
            for j in done:
                self._complete(j)

    def _adjacent(self, run: Run, prio: int) -> list[tuple[_Job, Run]]:
        """Caller holds _cv. Queued runs of other jobs (at `prio` or more urgent) that continue `run` in the same
        remote file, taken now so that one HTTP request fetches them all: adjacent experts coalesced."""
        cands: dict[int, tuple[_Job, Run]] = {}  # id(job) -> its next run, if it lies after `run` in the file
        for p, _, j in self._queue:
            if p <= prio and j.next < len(j.plan.runs) and j.error is None:
                r = j.plan.runs[j.next]
                if r.file == run.file and r.start > run.start:
                    cands.setdefault(id(j), (j, r))
        out, end, total = [], run.start + run.length, run.length
        # aligned runs of neighbouring experts may overlap by up to ALIGN bytes; holes up to GAP are read through
        for j, r in sorted(cands.values(), key=lambda jr: jr[1].start):
            if r.start < end - ALIGN or r.start > end + GAP or total >= COALESCE_MAX:
                break
            j.next += 1  # its queue entry is skipped when popped (like a cancelled job's)
            out.append((j, r))
            end, total = max(end, r.start + r.length), total + r.length
        return out

    @staticmethod
    def _read_batch(batch: list[tuple[_Job, Run]]) -> int:
        """One request for neighbouring runs of a remote file, scattered into each job's buffer."""
        batch[0][1].file.read_pieces([(r.start, memoryview(j.buf)[r.dst:r.dst + r.length]) for j, r in batch])
        return 1

    def _complete(self, job: _Job) -> None:
        buf, fut, then = job.buf, job.future, job.then
        _detach(job)
        if job.error is not None:
            self.pool.give(buf)
            fut.set_exception(job.error)
            return
        self._account(job.plan, job.calls)
        try:
            fut.set_result(then(buf) if then else buf)
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)

    def _begin(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.perf_counter()
            self._inflight += 1

    def _end(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self.stats.busy_s += time.perf_counter() - self._busy_since

    def _account(self, plan: ReadPlan, calls: int) -> None:
        with self._lock:
            self.stats.bytes_read += plan.nbytes
            self.stats.requests += len(plan.runs)
            self.stats.preads += calls

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._workers:
            t.join()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def file_resident_pages(path: str | Path) -> tuple[int, int]:
    """(resident, total) pages of `path` in the OS page cache, via mincore (Linux; (0, total) elsewhere)."""
    import ctypes
    import ctypes.util

    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    total = -(-size // page)
    if size == 0:
        return 0, 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return 0, total
        try:
            vec = ctypes.create_string_buffer(total)
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                return 0, total
            return sum(b & 1 for b in vec.raw), total
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
