"""The SSD tier: byte ranges of remote files kept on local disk under a byte budget.

Owns the on-disk layout (`ranges/<file key>/<offset>-<length>.rng`, one file per fetched range, a header carrying
a crc32 per 1 MiB block and its own crc32), atomic writes (temp file, then rename: a killed process leaves at most
an orphan temp file; a power loss may tear a renamed file, which its checksums reject, so it is never trusted),
verification of every block read, lookup of a request covered by one or several cached ranges, and eviction of the
least recently used ranges when the budget is exceeded. Processes sharing a directory serialise usage accounting
(`usage`: one checksummed record rewritten in place, rebuilt by a scan when torn or absent) and eviction with flock;
reads need no lock (a range file is immutable, and unlinking it leaves open descriptors valid). It never talks to
the network.
"""
from __future__ import annotations

import atexit
import bisect
import ctypes
import queue
import weakref
import fcntl
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from moestream.weights.buffers import Lease, aligned, copy_into

from moestream.weights.crc import crc32  # the data blocks' (the headers' small crcs use zlib's)

MAGIC, VERSION = b"MSRG", 1
BLOCK = 1 << 20  # checksum granularity: a read verifies only the blocks it touches
_HEAD = struct.Struct("<4sIQQI")  # magic, version, offset, length, block size; then crc32 per block, header crc32
DATA_ALIGN = 4096
HEADERS_KEPT = 1 << 16  # range headers remembered (a few hundred bytes each)
# a range read again within this many seconds of this process's last touch keeps its mtime (the eviction order):
# an mtime update per read is an inode write per expert read, and LRU order needs no finer grain than this
TOUCH_S = 10.0
RESCAN_S = 1.0  # a missing range re-lists its file's directory at most this often (other processes add ranges)
EVICT_TO = 0.9  # evict down to this share of the budget, so eviction does not run on every insert
# bytes handed to `put_soon` and not yet on disk, at most (beyond it the caller writes itself); a put costs a few ms
# of renames and locking that a read which fetched the bytes should not wait for
PENDING_MAX = 64 << 20


@dataclass
class DiskStats:
    hit_bytes: int = 0  # bytes served from disk
    put_bytes: int = 0  # bytes written to disk
    corrupt_ranges: int = 0  # range files that failed verification (deleted, fetched again)
    evicted_bytes: int = 0


@dataclass(frozen=True)
class _Range:
    offset: int
    length: int
    path: Path

    @property
    def end(self) -> int:
        return self.offset + self.length


def _data_start(nblocks: int) -> int:
    head = _HEAD.size + 4 * nblocks + 4
    return -(-head // DATA_ALIGN) * DATA_ALIGN


class DiskCache:
    """Ranges of remote files under `root`, at most `budget` bytes of range files (None: no limit)."""

    def __init__(self, root: str | Path, budget: int | None = None):
        self.root = Path(root)
        self.budget = budget
        self.stats = DiskStats()
        (self.root / "ranges").mkdir(parents=True, exist_ok=True)
        (self.root / "tmp").mkdir(exist_ok=True)
        self._lockfile = self.root / ".lock"
        self._index: dict[str, list[_Range]] = {}  # file key -> ranges sorted by offset (refreshed on a miss)
        self._longest: dict[str, int] = {}
        self._scanned: dict[str, float] = {}  # key -> when its directory was last listed
        self._mu = threading.Lock()
        self._headers: dict[Path, list[int]] = {}  # range file -> its block checksums (checked when first read)
        self._touched: dict[Path, float] = {}  # range file -> time.monotonic() of this process's last touch
        self._direct = hasattr(os, "O_DIRECT")
        self._direct_write = hasattr(os, "O_DIRECT")  # False once the filesystem refused an O_DIRECT write
        self._pending: dict[tuple[str, int], bytes] = {}  # (key, offset) -> bytes queued for the writer
        self._leases: dict[tuple[str, int], Lease] = {}  # ... the pooled buffer a queued range lives in, held for it
        self._pending_bytes = 0
        self._writes: queue.Queue | None = None
        self._clean_orphans()

    # ---- lookup and read ---------------------------------------------------------------------------
    def read(self, key: str, offset: int, out: memoryview) -> bool:
        """Fill `out` from cached ranges of file `key` starting at `offset`; False (out untouched or partly
        written) when they do not cover it or a covering range fails its checksum (that range is deleted)."""
        if self._from_pending(key, offset, out):
            return True
        for attempt in range(2):
            cover = self._cover(key, offset, len(out))
            if cover is None and attempt == 0 and self._stale(key):
                self._scan(key)  # another process may have added ranges since we last looked
                continue
            if cover is None:
                return False
            if all(self._read_piece(key, r, offset, out) for r in cover):
                self.stats.hit_bytes += len(out)
                self._touch(cover)
                return True
        return False

    def covered(self, key: str, offset: int, length: int) -> bool:
        """Whether [offset, offset + length) of `key` is on disk or queued for it (no verification)."""
        if self._pending_range(key, offset, length) is not None or self._cover(key, offset, length) is not None:
            return True
        if self._stale(key):
            self._scan(key)
        return self._cover(key, offset, length) is not None

    def _stale(self, key: str) -> bool:
        """Whether `key`'s listing is worth re-reading on a miss (at most every RESCAN_S: a miss is usually real)."""
        with self._mu:
            return time.monotonic() - self._scanned.get(key, -RESCAN_S) >= RESCAN_S

    def _cover(self, key: str, offset: int, length: int) -> list[_Range] | None:
        with self._mu:
            ranges = self._index.get(key)
            if ranges is None:
                return None
            longest = self._longest.get(key, 0)
            starts = [r.offset for r in ranges]
            pos, end, out = offset, offset + length, []
            while pos < end:
                i = bisect.bisect_right(starts, pos)
                best = None
                j = i - 1
                while j >= 0 and ranges[j].offset + longest > pos:  # only ranges that could reach pos
                    if ranges[j].end > pos and (best is None or ranges[j].end > best.end):
                        best = ranges[j]
                    j -= 1
                if best is None:
                    return None
                out.append(best)
                pos = best.end
            return out

    def _touch(self, cover: list[_Range]) -> None:
        """Mark ranges recently used, at most once per TOUCH_S each by this process."""
        now = time.monotonic()
        for r in cover:
            if now - self._touched.get(r.path, -TOUCH_S) >= TOUCH_S:
                if len(self._touched) >= HEADERS_KEPT:
                    self._touched.clear()
                self._touched[r.path] = now
                _touch(r.path)

    def _read_piece(self, key: str, r: _Range, offset: int, out: memoryview) -> bool:
        """Copy the part of range `r` that overlaps the request into `out`, verifying each block it touches (every
        read: crc32 costs far less than the read, and a cached range is trusted only as far as its checksums). A
        request for whole blocks (an expert read as the range it was fetched as) lands in `out` directly."""
        lo, hi = max(offset, r.offset), min(offset + len(out), r.end)
        b0, b1 = (lo - r.offset) // BLOCK, -(-(hi - r.offset) // BLOCK)
        crcs = self._crcs(key, r)
        if crcs is None:
            return False
        span_lo, span_hi = b0 * BLOCK, min(b1 * BLOCK, r.length)
        exact = span_lo == lo - r.offset and span_hi == hi - r.offset
        dst = out[lo - offset:hi - offset] if exact else memoryview(bytearray(span_hi - span_lo))
        got = self._read_data(r.path, _data_start(len(crcs)) + span_lo, dst)
        if got is None:  # evicted since the lookup
            self._drop_from_index(key, r)
            return False
        if got != len(dst):
            return self._corrupt(key, r)
        for b in range(b0, b1):
            a = b * BLOCK - span_lo
            if crc32(dst[a:min(a + BLOCK, len(dst))]) != crcs[b]:
                return self._corrupt(key, r)
        if not exact:
            out[lo - offset:hi - offset] = dst[lo - r.offset - span_lo:hi - r.offset - span_lo]
        return True

    def _crcs(self, key: str, r: _Range) -> list[int] | None:
        """The block checksums of range `r`, read and checked once (a range's bytes never change: its name is its
        file's version and position), remembered after. None when the file is gone or its header is damaged."""
        crcs = self._headers.get(r.path)
        if crcs is not None:
            return crcs
        try:
            fd = os.open(r.path, os.O_RDONLY)
        except FileNotFoundError:  # evicted by another process since the scan
            self._drop_from_index(key, r)
            return None
        try:
            crcs = _read_header(fd, r)
        finally:
            os.close(fd)
        if crcs is None:
            self._corrupt(key, r)
            return None
        if len(self._headers) >= HEADERS_KEPT:
            self._headers.clear()
        self._headers[r.path] = crcs
        return crcs

    def _read_data(self, path: Path, at: int, dst: memoryview) -> int | None:
        """Read len(dst) bytes at `at` of a range file into `dst`: O_DIRECT when `dst` is 4 KiB aligned (as the
        reader's expert buffers are; the range file's data is too), so the SSD tier reads like a local checkpoint
        and leaves nothing in the page cache; else buffered with a read-ahead hint and the pages dropped after.
        Returns the bytes read, None when the file is gone."""
        head = len(dst) - len(dst) % DATA_ALIGN if self._direct and _aligned(dst) else 0
        done = 0
        if head:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except FileNotFoundError:
                return None
            except OSError:  # no O_DIRECT on this filesystem (tmpfs): buffered from now on
                self._direct, head = False, 0
            else:
                try:
                    done = os.preadv(fd, [dst[:head]], at)
                except OSError:
                    self._direct, done = False, 0
                finally:
                    os.close(fd)
                if done == len(dst) or (done and done != head):
                    return done
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            rest = dst[done:]
            if hasattr(os, "posix_fadvise"):  # one large read-ahead instead of the default 128 KiB window steps
                os.posix_fadvise(fd, at + done, len(rest), os.POSIX_FADV_WILLNEED)
            done += os.preadv(fd, [rest], at + done)
            if hasattr(os, "posix_fadvise"):  # the RAM tier holds what it needs; do not double it in page cache
                os.posix_fadvise(fd, at, len(dst), os.POSIX_FADV_DONTNEED)
            return done
        finally:
            os.close(fd)

    def _corrupt(self, key: str, r: _Range) -> bool:
        self.stats.corrupt_ranges += 1
        self._remove(key, r)
        return False

    def _remove(self, key: str, r: _Range) -> int:
        """Delete range file `r` (if still there) and give its bytes back to the budget; returns them."""
        self._headers.pop(r.path, None)
        size = 0
        with self._locked():
            before = self._usage()
            try:
                size = r.path.stat().st_size
                r.path.unlink()
                self._set_usage(before - size)
            except FileNotFoundError:
                pass
        self._drop_from_index(key, r)
        return size

    # ---- insert -------------------------------------------------------------------------------------
    def put_soon(self, key: str, offset: int, data: bytes | bytearray | memoryview,
                 lease: Lease | None = None) -> None:
        """`put` on a writer thread: until the range is on disk, `read` and `covered` serve it from `data` (which
        the caller must not change afterwards). A process that dies first loses it (fetched again when next
        needed), like a range whose request was in flight. Past PENDING_MAX queued, the caller writes. `lease`:
        the pooled buffer `data` lies in (weights/buffers.py), held here until the range is written or dropped."""
        with self._mu:
            queued = self._pending.get((key, offset))
            if queued is not None and len(queued) == len(data):
                return  # the same bytes are queued already
            if self._pending_bytes + len(data) > PENDING_MAX or queued is not None:
                wait = True
            else:
                wait = False
                if lease is not None:
                    lease.hold()
                    self._leases[(key, offset)] = lease
                self._pending[(key, offset)] = data
                self._pending_bytes += len(data)
                if self._writes is None:
                    self._writes = queue.Queue()
                    ref = weakref.ref(self)
                    threading.Thread(target=_writer, args=(ref, self._writes), name="moestream-ssd-writer",
                                     daemon=True).start()
                    atexit.register(_flush_at_exit, ref)
                self._writes.put((key, offset))
        if wait:
            self.put(key, offset, data)

    def flush(self) -> None:
        """Wait until every `put_soon` range is on disk."""
        if self._writes is not None:
            self._writes.join()

    def _write_pending(self, key: str, offset: int) -> None:
        with self._mu:
            data = self._pending.get((key, offset))
            lease = self._leases.get((key, offset)) if data is not None else None
            if lease is not None:  # the writer's own hold: a discard meanwhile must not recycle what it writes
                lease.hold()
        try:
            if data is not None:
                self.put(key, offset, data)
        finally:
            self._unqueue(key, offset)
            if lease is not None:
                lease.release()

    def _unqueue(self, key: str, offset: int) -> None:
        """A queued range leaves the queue (written, or dropped), and its hold on a pooled buffer goes."""
        with self._mu:
            data = self._pending.pop((key, offset), None)
            if data is not None:
                self._pending_bytes -= len(data)
            lease = self._leases.pop((key, offset), None)
        if lease is not None:
            lease.release()

    def _pending_range(self, key: str, offset: int, length: int,
                       hold: bool = False) -> tuple[int, bytes, Lease | None] | None:
        """(offset, bytes, pooled buffer) of a range queued for the writer that covers the request; `hold`: the
        buffer is held for the caller (who releases it), so it is not reused while being read."""
        with self._mu:
            for (k, off), data in self._pending.items():
                if k == key and off <= offset and offset + length <= off + len(data):
                    lease = self._leases.get((k, off)) if hold else None
                    if lease is not None:
                        lease.hold()
                    return off, data, lease
        return None

    def _from_pending(self, key: str, offset: int, out: memoryview) -> bool:
        got = self._pending_range(key, offset, len(out), hold=True) if self._pending else None
        if got is None:
            return False
        off, data, lease = got
        try:
            copy_into(out, memoryview(data)[offset - off:offset - off + len(out)])
        finally:
            if lease is not None:
                lease.release()
        self.stats.hit_bytes += len(out)
        return True

    def put(self, key: str, offset: int, data: memoryview | bytes) -> None:
        """Store bytes [offset, offset + len(data)) of `key` atomically, then evict past the budget."""
        data = memoryview(data).cast("B")
        if len(data) == 0 or (self.budget is not None and len(data) > self.budget):
            return
        nblocks = -(-len(data) // BLOCK)
        crcs = [crc32(data[b * BLOCK:(b + 1) * BLOCK]) for b in range(nblocks)]
        head = _HEAD.pack(MAGIC, VERSION, offset, len(data), BLOCK) + struct.pack(f"<{nblocks}I", *crcs)
        head += struct.pack("<I", zlib.crc32(head))
        final = self._range_path(key, offset, len(data))
        tmp = self.root / "tmp" / f"{os.getpid()}-{threading.get_ident()}-{final.name}"
        # no fsync either way: the rename makes a complete file visible to other processes, and a range torn by a
        # power loss fails its header or block checksums on read and is fetched again (never trusted)
        if not (self._direct_write and _aligned(data) and self._put_direct(tmp, head, nblocks, data)):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.pwrite(fd, head.ljust(_data_start(nblocks), b"\0"), 0)
                _pwrite_all(fd, data, _data_start(nblocks))
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        size = _data_start(nblocks) + len(data)
        final.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            before = self._usage()  # read before the rename: a rebuilt count must not include the new file twice
            existed = final.exists()
            os.replace(tmp, final)  # atomic: readers see the old complete file or the new complete one
            if not existed:
                self._set_usage(before + size)
            self.stats.put_bytes += len(data)
            self._insert(key, _Range(offset, len(data), final))
            if self.budget is not None and self._usage() > self.budget:
                self._evict(keep=final)

    def _put_direct(self, tmp: Path, head: bytes, nblocks: int, data: memoryview) -> bool:
        """Write range file `tmp` with O_DIRECT from the page-aligned `data` (the header and a partial last page
        through small aligned buffers, the file cut to length after): no copy into the page cache and no
        write-back from it, which a buffered write pays per byte. False (nothing trusted from `tmp`) when the
        filesystem refuses O_DIRECT; later puts then write buffered."""
        start, whole = _data_start(nblocks), len(data) - len(data) % DATA_ALIGN
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:
            self._direct_write = False
            return False
        try:
            block = aligned(start)
            block[:len(head)] = head
            _pwrite_all(fd, block, 0)
            if whole:
                _pwrite_all(fd, data[:whole], start)
            if whole < len(data):
                tail = aligned(DATA_ALIGN)
                tail[:len(data) - whole] = data[whole:]
                _pwrite_all(fd, tail, start + whole)
                os.ftruncate(fd, start + len(data))
            return True
        except OSError:
            self._direct_write = False
            return False
        finally:
            os.close(fd)

    def discard(self, key: str, offset: int, length: int) -> None:
        """Remove the range stored as exactly [offset, offset + length) of `key` (a fetch-ahead guess no read used),
        if it is there; its room goes back to the budget."""
        self._unqueue(key, offset)  # not on disk yet: the writer skips it
        self.stats.evicted_bytes += self._remove(key, _Range(offset, length, self._range_path(key, offset, length)))

    # ---- budget -------------------------------------------------------------------------------------
    def usage(self) -> int:
        with self._locked():
            return self._usage()

    def _usage(self) -> int:
        """Caller holds the lock. Bytes of range files, as recorded in `usage` (rebuilt by a scan if absent, or not
        a record with its checksum: a torn write, or another version's format)."""
        try:
            fd = os.open(self.root / "usage", os.O_RDONLY)
        except OSError:
            return self._rescan_usage()
        try:
            return _parse_usage(os.pread(fd, USAGE_RECORD, 0))
        except (OSError, ValueError):
            return self._rescan_usage()
        finally:
            os.close(fd)

    def _set_usage(self, total: int) -> None:
        """Caller holds the lock: the record rewritten in place (one pwrite of one sector; a new file and a rename
        per insert cost an inode allocated and one freed, and on an ext4 without a journal every later file
        creation scans past the recently freed inodes: ~0.5 ms of CPU per range written after a few thousand)."""
        fd = os.open(self.root / "usage", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, _usage_record(max(0, total)), 0)
        finally:
            os.close(fd)

    def _rescan_usage(self) -> int:
        total = sum(f.stat().st_size for f in self._all_files())
        self._set_usage(total)
        return total

    def _evict(self, keep: Path | None = None) -> None:
        """Caller holds the lock: delete least recently used range files until usage is under the target."""
        files = []
        for f in self._all_files():
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, f))
        total = sum(s for _, s, _ in files)
        target = int(self.budget * EVICT_TO) if self.budget is not None else total
        for _, size, f in sorted(files, key=lambda t: t[0]):
            if total <= target:
                break
            if f == keep:
                continue
            f.unlink(missing_ok=True)
            total -= size
            self.stats.evicted_bytes += size
        self._set_usage(total)
        with self._mu:
            self._index.clear()  # rebuilt lazily from the directories
            self._longest.clear()
            self._scanned.clear()

    def _all_files(self) -> list[Path]:
        return [f for d in (self.root / "ranges").iterdir() if d.is_dir() for f in d.glob("*.rng")]

    # ---- index maintenance --------------------------------------------------------------------------
    def _dir(self, key: str) -> Path:
        return self.root / "ranges" / key

    def _range_path(self, key: str, offset: int, length: int) -> Path:
        return self._dir(key) / f"{offset:016x}-{length:016x}.rng"

    def _scan(self, key: str) -> None:
        ranges = []
        d = self._dir(key)
        if d.is_dir():
            for f in d.glob("*.rng"):
                try:
                    a, b = f.stem.split("-")
                    ranges.append(_Range(int(a, 16), int(b, 16), f))
                except ValueError:
                    continue
        ranges.sort(key=lambda r: r.offset)
        with self._mu:
            self._scanned[key] = time.monotonic()
            self._index[key] = ranges
            self._longest[key] = max((r.length for r in ranges), default=0)

    def _insert(self, key: str, r: _Range) -> None:
        with self._mu:
            ranges = self._index.get(key)
            if ranges is None:
                return  # scanned on the next lookup
            if r not in ranges:
                bisect.insort(ranges, r, key=lambda x: x.offset)
                self._longest[key] = max(self._longest.get(key, 0), r.length)

    def _drop_from_index(self, key: str, r: _Range) -> None:
        with self._mu:
            ranges = self._index.get(key)
            if ranges is not None and r in ranges:
                ranges.remove(r)

    def _locked(self):
        return _FileLock(self._lockfile)

    def _clean_orphans(self) -> None:
        """Temp files of processes that died mid-write are removed (those of live processes are left alone)."""
        for f in (self.root / "tmp").iterdir():
            pid = f.name.split("-", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                f.unlink(missing_ok=True)

    def verify_all(self) -> tuple[int, int]:
        """(ranges checked, ranges corrupt) over the whole directory; corrupt ones are deleted."""
        checked = bad = 0
        for f in self._all_files():
            a, b = f.stem.split("-")
            r = _Range(int(a, 16), int(b, 16), f)
            key = f.parent.name
            checked += 1
            if not self._read_piece(key, r, r.offset, memoryview(bytearray(r.length))):
                bad += 1
        return checked, bad


def _writer(ref: weakref.ref, jobs: queue.Queue) -> None:
    """The writer thread of one DiskCache's `put_soon` ranges (holds it only while writing)."""
    while True:
        key, offset = jobs.get()
        cache = ref()
        try:
            if cache is not None:
                cache._write_pending(key, offset)
        except OSError:  # a full or failing disk: the range is fetched again when next needed
            pass
        finally:
            del cache
            jobs.task_done()


def _flush_at_exit(ref: weakref.ref) -> None:
    cache = ref()
    if cache is not None:
        cache.flush()


class _FileLock:
    """flock on a lock file, plus a process-local mutex (flock does not exclude threads sharing the file)."""

    _local = threading.RLock()

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> "_FileLock":
        self._local.acquire()
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self._local.release()


def _read_header(fd: int, r: _Range) -> list[int] | None:
    """The per-block crc32s of a range file, or None when its header is damaged or does not match its name."""
    nblocks = -(-r.length // BLOCK)
    n = _HEAD.size + 4 * nblocks + 4
    raw = os.pread(fd, n, 0)
    if len(raw) != n or zlib.crc32(raw[:-4]) != struct.unpack("<I", raw[-4:])[0]:
        return None
    magic, version, offset, length, block = _HEAD.unpack_from(raw)
    if (magic, version, offset, length, block) != (MAGIC, VERSION, r.offset, r.length, BLOCK):
        return None
    return list(struct.unpack_from(f"<{nblocks}I", raw, _HEAD.size))


def _aligned(view: memoryview) -> bool:
    """Whether a writable buffer starts on a DATA_ALIGN boundary (what O_DIRECT needs of its destination)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)) % DATA_ALIGN == 0
    except (TypeError, ValueError):  # read-only or empty
        return False


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], at + done)


USAGE_RECORD = 30  # "<bytes, 20 digits> <crc32 of them, 8 hex>\n"


def _usage_record(total: int) -> bytes:
    digits = b"%020d" % total
    return digits + b" %08x\n" % zlib.crc32(digits)


def _parse_usage(raw: bytes) -> int:
    """The byte count of a usage record; ValueError unless it is one whose checksum matches."""
    if len(raw) != USAGE_RECORD or raw[20:21] != b" " or raw[-1:] != b"\n" or \
            int(raw[21:29], 16) != zlib.crc32(raw[:20]):
        raise ValueError("not a usage record")
    return int(raw[:20])


def _touch(path: Path) -> None:
    """Mark a range recently used (its mtime is the eviction order, shared by every process)."""
    try:
        os.utime(path)
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
