"""Where a batch job's RSS goes, step by step: a debugging aid for the RSS-over-bound question (issue #11).

`RssTrace(engine, path)` wraps `engine.step` and runs a sampling thread. The thread reads /proc/self/statm every
`interval` seconds; at each new in-step maximum of RSS it snapshots what could explain it (the accountant's bytes
by kind, the reader's idle expert buffers, the KV slabs' mapped and given-out bytes, glibc's `mallinfo2`, Python's
allocated blocks). After each step one JSON line goes to `path`: the step's rows and segments, the RSS and VmHWM
at its end, smaps_rollup's anonymous / file split, and the snapshot at the step's RSS maximum. Sampling costs a
little CPU (a thread waking every `interval`), so runs with a trace are for finding bytes, not for timing.

    python bench/batch_throughput.py ... --rss-trace /tmp/trace.jsonl
    python bench/rss_trace.py /tmp/trace.jsonl     # the steps where VmHWM rose, and the snapshot at the peak
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import sys
import threading
import time
from pathlib import Path


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    return fn


_MALLINFO2 = _mallinfo2()


def heap() -> dict:
    """glibc's heap figures (every arena): bytes of the arenas (sbrk + thread heaps), in use and free in them, and
    in mmapped chunks."""
    if _MALLINFO2 is None:
        return {}
    m = _MALLINFO2()
    return {"arena": m.arena, "in_use": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd, "mmapped_n": m.hblks}


def statm() -> tuple[int, int]:
    """(RSS, file-backed + shmem RSS) in bytes."""
    with open("/proc/self/statm") as fh:
        f = fh.read().split()
    return int(f[1]) * mmap.PAGESIZE, int(f[2]) * mmap.PAGESIZE


def rollup() -> dict:
    out = {}
    try:
        with open("/proc/self/smaps_rollup") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                if k in ("Rss", "Anonymous", "Private_Dirty", "Shared_Clean", "Private_Clean", "AnonHugePages"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _address(buf) -> int | None:
    try:
        probe = ctypes.c_char.from_buffer(buf)
    except (TypeError, ValueError):
        return None
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


def known_mappings(engine) -> dict[int, str]:
    """Start address -> what it is, for the mappings the engine made itself: KV slabs, cached and idle expert
    buffers. Call from the engine's own thread (the cache is not locked)."""
    from moestream.memory import slabs

    out: dict[int, str] = {}
    with slabs._pools_lock:
        pools = list(slabs._pools.values())
    for p in pools:
        for mm in list(p.slabs):
            a = _address(mm)
            if a is not None:
                out[a] = "slab"
    cache = engine.memory.cache
    for blob, _ in list(cache._items.values()) if cache is not None else []:
        a = _address(blob.buf)
        if a is not None:
            out[a] = "expert_cached"
    pool = engine.plan.store.reader.pool
    with pool._lock:
        idle = [b for lst in pool._free.values() for b, _ in lst]
    for b in idle:
        a = _address(b)
        if a is not None:
            out[a] = "expert_idle"
    return out


def anon_maps(known: dict[int, str] | None = None) -> dict:
    """RSS of the process's anonymous mappings by kind: `known` start addresses (slabs, expert buffers), the brk
    heap, 64 MiB-aligned ones of at most 64 MiB (glibc's thread arenas), exactly 1 MiB (CPython's object arenas),
    and the rest by size ("MiB:N" rounded down, "small" under 1 MiB) with their count."""
    known = known or {}
    out: dict[str, int] = {}
    key = None
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split()
                if "-" in head[0] and len(head) >= 5 and not line.startswith(("Rss", "Size")):
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    path = head[5] if len(head) > 5 else ""
                    size = hi - lo
                    if path == "[heap]":
                        key = "brk_heap"
                    elif path:
                        key = None if path.startswith("/") else path
                    elif lo in known:
                        key = known[lo]
                    elif lo % (64 << 20) == 0 and size <= 64 << 20:
                        key = "thread_arena"
                    elif size == 1 << 20:
                        key = "1MiB"
                    elif size < 1 << 20:
                        key = "small"
                    else:
                        key = f"MiB:{size >> 20}"
                    if key is not None:
                        out["n:" + key] = out.get("n:" + key, 0) + 1
                elif head[0] == "Rss:" and key is not None:
                    out[key] = out.get(key, 0) + int(head[1]) * 1024
    except OSError:
        pass
    return out


def vm_hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_bytes(mm: mmap.mmap) -> int:
    """Bytes of an anonymous mapping's pages that are resident (mincore)."""
    n = len(mm)
    pages = -(-n // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    probe = ctypes.c_char.from_buffer(mm)
    try:
        if _LIBC.mincore(ctypes.addressof(probe), n, vec) != 0:
            return -1
    finally:
        del probe
    return (pages - vec.raw.count(0)) * mmap.PAGESIZE


def books(engine) -> dict:
    """What the engine's own books say is resident, and the mapped memory outside them."""
    from moestream.memory import slabs

    mem = engine.memory
    cache = mem.cache.resident_bytes if mem.cache is not None else 0
    with slabs._pools_lock:
        pools = list(slabs._pools.values())
    slab_mapped = sum(len(p.slabs) * p.per_slab * p.slot_bytes for p in pools)
    slab_out = sum(p.slots_out * p.slot_bytes for p in pools)
    slab_resident = sum(resident_bytes(mm) for p in pools for mm in list(p.slabs))
    return {"dense": mem.dense_bytes, "state": mem.state_bytes, "scratch": mem.scratch_bytes,
            "stream": mem.stream_bytes, "cache": cache, "resident": mem.resident(),
            "unbooked": getattr(mem, "unbooked_bytes", 0),
            "idle_expert_buffers": engine.plan.store.reader.pool.idle_bytes,
            "slab_mapped": slab_mapped, "slab_out": slab_out, "slab_resident": slab_resident, "py_blocks": sys.getallocatedblocks()}


def base() -> dict:
    """The process before the engine opens (where the bench reads its interpreter RSS): RSS, its file-backed part,
    smaps_rollup and the heap."""
    rss, file = statm()
    return {"rss": rss, "rss_file": file, "rollup": rollup(), **{"heap_" + k: v for k, v in heap().items()},
            "py_blocks": sys.getallocatedblocks(), "maps": anon_maps()}


class RssTrace:
    def __init__(self, engine, path: str | Path, interval: float = 0.005, before: dict | None = None):
        self.engine, self.path, self.interval = engine, Path(path), interval
        self.out = self.path.open("w")
        self.out.write(json.dumps({"step": None, "what": "before the engine opened", "hwm": 0, "peak": before})
                       + "\n")
        self.lock = threading.Lock()
        self.top = (0, None)  # (RSS, snapshot) at this step's RSS maximum so far
        self.n = self.hwm = 0
        self.stop = threading.Event()
        self._inner = engine.step
        engine.step = self._step
        self.thread = threading.Thread(target=self._run, name="rss-trace", daemon=True)
        self.thread.start()

    def _snap(self, rss: int, file: int) -> dict:
        return {"rss": rss, "rss_file": file, **books(self.engine), **{"heap_" + k: v for k, v in heap().items()}}

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            rss, file = statm()
            if rss > self.top[0]:
                snap = self._snap(rss, file)
                with self.lock:
                    if rss > self.top[0]:
                        self.top = (rss, snap)

    def _step(self, items, all_logits: bool = False):
        segs = [len(t) for _, t in items if len(t) > 0]
        rss, file = statm()
        with self.lock:
            between, self.top = self.top, (rss, self._snap(rss, file))
        t0 = time.perf_counter()
        out = self._inner(items, all_logits)
        rss, file = statm()
        with self.lock:
            top, self.top = self.top, (0, None)
        rec = {"step": self.n, "rows": sum(segs), "segments": len(segs),
               "decode": sum(1 for n in segs if n == 1), "seconds": time.perf_counter() - t0,
               "hwm": vm_hwm(), "end": self._snap(rss, file), "rollup": rollup(), "peak": top[1],
               "between_peak": between[1]}
        if rec["hwm"] > self.hwm:  # the mapping breakdown where the peak grew (a walk of /proc/self/smaps)
            self.hwm, rec["maps"] = rec["hwm"], anon_maps(known_mappings(self.engine))
        self.out.write(json.dumps(rec) + "\n")
        self.out.flush()
        self.n += 1
        return out

    def close(self, what: str = "after the last step") -> None:
        """Stop sampling; the last line holds the RSS maximum since the last step (`what` names that span)."""
        self.stop.set()
        self.thread.join()
        self.engine.step = self._inner
        with self.lock:
            top = self.top
        self.out.write(json.dumps({"step": None, "what": what, "hwm": vm_hwm(), "peak": top[1]}) + "\n")
        self.out.close()


def summary(path: str | Path, base_rss: int | None = None) -> str:
    """The steps whose VmHWM rose (last 12), and the snapshot at the peak: RSS minus the books, item by item."""
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    lines, hwm, tail, mib = [], 0, [], 1 << 20
    rose = []
    for r in recs:
        if r["step"] is None:
            p = r["peak"] or {}
            if r["what"].startswith("before"):
                lines.append(f"before: rss {p.get('rss', 0) / mib:.1f} file {p.get('rss_file', 0) / mib:.1f} heap "
                             f"arena {p.get('heap_arena', 0) / mib:.1f} free {p.get('heap_free', 0) / mib:.1f} "
                             f"mmapped {p.get('heap_mmapped', 0) / mib:.1f}")
                continue
            tail.append(f"{r['what']}: hwm {r['hwm'] / (1 << 20):.1f} MiB, sampled maximum "
                        f"{p.get('rss', 0) / (1 << 20):.1f}")
            continue
        if r["hwm"] > hwm:
            rose.append(r)
            hwm = r["hwm"]
    mib = 1 << 20
    for r in rose[-12:]:
        p = r["peak"] or r["end"]
        lines.append(f"step {r['step']:4d} rows {r['rows']:5d} segs {r['segments']:4d} hwm {r['hwm'] / mib:8.1f} "
                     f"peak-rss {p['rss'] / mib:8.1f} books {p['resident'] / mib:7.1f} "
                     f"state {p['state'] / mib:6.1f} cache {p['cache'] / mib:6.1f} idle {p['idle_expert_buffers'] / mib:5.1f} "
                     f"heap arena {p.get('heap_arena', 0) / mib:6.1f} free {p.get('heap_free', 0) / mib:5.1f} "
                     f"mmapped {p.get('heap_mmapped', 0) / mib:6.1f} file {p['rss_file'] / mib:6.1f}")
    lines += tail
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
