"""The C heap's behaviour under a RAM budget: big temporaries go back to the OS when freed, and so do free holes.

Owns the process-wide malloc settings and the heap trim after engine steps. glibc keeps freed memory in its heap
and, by default, raises its mmap threshold each time a large block is freed, so later megabyte-sized temporaries
(torch activations, upcast slabs) are carved from the heap and the heap's high-water mark stays resident: measured
on a medium synthetic model, 45-55 MB of RSS beyond everything the budget accounts for, growing during decode. A
fixed mmap threshold sends every block above it to its own mapping (returned on free); a trim threshold returns
the heap's free top beyond a fixed 1 MiB. A zero trim threshold had the same peak RSS but gave the top back after
nearly every free, and took it again on the next allocation: a warm decode step of the medium model was 8-25%
slower.

Those settings only shrink a heap from its top. The free holes that smaller allocations leave between live ones
stay resident: after a batch job's prefill and mixed steps, 75 MB of free heap (`mallinfo2().fordblks`) at the
peak step, RSS beyond the books. `HeapTrim.after_step` gives their pages back with malloc_trim(0) after an engine
step, at most once a second (a 1-4 ms call: a batch step of seconds pays it each time, a 60 ms decode step once in
many) (docs/performance.md).

A step of many rows (a prompt chunk, a batch step) makes its temporaries on the heap instead (`StepHeap`): each
fresh mapping above the fixed threshold faults in every page it touches, which made a 512-token prefill take 1.4x
as long; the step's freed temporaries are reused by its later ones and given back with malloc_trim(0) when it ends.
In an engine whose RSS a server or batch scheduler holds to the budget, only in steps of decoding sequences (below);
its other large steps give the heap's free pages back after each layer (`StepHeap.trim_layer`): the step heap
leaves a wide span of trimmed free pages that a later step's small blocks, carved from it as the step goes, fault in
again.

Even trimmed, a heap keeps what its live neighbours pin: when a batch job's sequences end, the small objects they
held (tensor objects of their cache blocks, per-sequence Python state, mostly in the engine thread's own glibc
arena) are freed among those still live, the books release their charge, the expert cache takes the room back,
and RSS ends above the budget (docs/memory.md: 25 MiB at the end of a 1,024-request job). `ResidentCheck`
measures the process's anonymous RSS after each layer of a step, after the step and again before the next, and
books what lies beyond the books (`set_unbooked`), so the expert cache gives that room up.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import threading
import time
from typing import Callable

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 10
TRIM_THRESHOLD_BYTES = 1 << 20

_done: bool | None = None


def _libc_fn(name: str, argtypes: list) -> ctypes._CFuncPtr | None:
    """A glibc function with its argument types set, None where this libc has none (musl, macOS)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


_MALLOPT = _libc_fn("mallopt", [ctypes.c_int, ctypes.c_int])


def return_freed_memory() -> bool:
    """Configure glibc's malloc once per process (no-op elsewhere, or with MOESTREAM_MALLOC_TUNING=0, the
    switch for A/B runs). True when the setting is in force."""
    global _done
    if _done is None:
        _done = False
        if sys.platform.startswith("linux") and os.environ.get("MOESTREAM_MALLOC_TUNING", "1") != "0":
            if _MALLOPT is None:  # not glibc (musl has no mallopt)
                return False
            _done = bool(_MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) \
                and bool(_MALLOPT(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _done


_TRIM = _libc_fn("malloc_trim", [ctypes.c_size_t])

# A step of many rows (a prompt chunk, a batch step) makes hundreds of temporaries of 64 KiB to tens of MB (a
# 512-row chunk of a hidden-1024 model: 2 MB activations, 10 MB upcast weights, the experts' outputs). Above the
# fixed mmap threshold each is a fresh mapping whose every page faults on first touch: a warm 512-token prefill of
# a 32-layer hidden-1024 qwen3_moe took 4.98-5.23 s with that setting against 3.44-3.66 s with glibc's defaults
# (docs/performance.md). So such a step runs with the heap taking blocks up to STEP_MMAP_THRESHOLD_BYTES and keeping
# its free top, and gives the freed pages back with malloc_trim(0) when it ends: a step's temporaries are faulted in
# once a step instead of once a block, and RSS after the step is what it was with the fixed setting. While the step
# runs the heap holds more than its live blocks (freed holes between them): a 512-token prefill of a published-width
# Kimi K3 peaked 120-170 MB higher with 8 MiB, 210-350 MB with 32 MiB (glibc's largest); larger blocks (K3's
# 15 MB activation rows) keep their own mappings. An engine whose RSS a server or batch scheduler holds to the budget
# (`Engine.watch_resident`) keeps the fixed setting in steps with a prompt chunk: that bound has no room for their
# holes (the 1,024-request job of docs/performance.md peaked 1.49 GB against its 1.23 GB bound with them, 1.22 GB
# without); a step of decoding sequences alone stays within the activations its caller charges and uses the step heap
# (`Engine._step_heap`).
STEP_MMAP_THRESHOLD_BYTES = 8 << 20
STEP_TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes an int: no trim while the step runs, the one at its end
STEP_HEAP_ROWS = 16  # rows a step has from which it runs on the step heap (a row's activation is 4 KiB a 1024 wide)


class StepHeap:
    """`with StepHeap.enter(rows):` a step of `rows` rows; from STEP_HEAP_ROWS rows (and where the fixed setting
    is in force) the heap keeps the step's freed temporaries for its later ones, and when the last such step in the
    process ends (steps of several engines on several threads nest), the fixed thresholds are restored and the
    freed pages given back (malloc_trim(0)). `trims` counts those. `enter(rows, heap=False)`: such a step keeps the
    fixed setting and its `after_layer` gives the heap's free pages back after each layer instead (`trim_layer`)."""

    depth = 0
    trims = 0
    layer_trims = 0
    _lock = threading.Lock()

    def __init__(self, active: bool, trim_layers: bool = False):
        self.active = active
        self.after_layer: Callable[[], None] | None = StepHeap.trim_layer if trim_layers else None

    @classmethod
    def enter(cls, rows: int, heap: bool = True) -> "StepHeap":
        large = rows >= STEP_HEAP_ROWS and bool(_done) and _MALLOPT is not None and _TRIM is not None
        return cls(large and heap, trim_layers=large and not heap)

    def __enter__(self) -> "StepHeap":
        if self.active:
            with StepHeap._lock:
                if StepHeap.depth == 0:
                    _MALLOPT(M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD_BYTES)
                    _MALLOPT(M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD_BYTES)
                StepHeap.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            with StepHeap._lock:
                StepHeap.depth -= 1
                if StepHeap.depth == 0:
                    _MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                    _MALLOPT(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
                    _TRIM(0)
                    StepHeap.trims += 1

    @classmethod
    def trim_layer(cls) -> None:
        """After a layer of a large step kept off the step heap: every arena's free pages back to the kernel now
        (malloc_trim(0)); `layer_trims` counts them."""
        _TRIM(0)
        cls.layer_trims += 1


def trim_available() -> bool:
    return _TRIM is not None


class HeapTrim:
    """malloc_trim(0) after a step, at most once per `every_s` seconds; `calls` counts the trims."""

    def __init__(self, every_s: float = 1.0):
        self.every_s, self.last, self.calls = every_s, time.monotonic(), 0

    def after_step(self) -> None:
        if _TRIM is None or time.monotonic() - self.last < self.every_s:
            return
        _TRIM(0)
        self.last, self.calls = time.monotonic(), self.calls + 1


def anon_rss() -> int:
    """This process's anonymous resident bytes (RSS less file-backed and shared pages), 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as fh:
            f = fh.read().split()
    except OSError:
        return 0
    return (int(f[1]) - int(f[2])) * mmap.PAGESIZE


def books_held(memory, idle: Callable[[], int]) -> int:
    """What the books say is resident (the measured part aside): the accountant's bytes, the stream reserve's
    buffers whole, and idle expert buffers (which the cache's free room covers)."""
    return memory.resident() - memory.unbooked_bytes + (memory.stream_reserve - memory.stream_bytes) + idle()


class StepRoom:
    """One step on the step heap (StepHeap) in an engine whose RSS no scheduler watches (`run`, `bench`, the
    library): the step heap keeps the step's freed temporaries until it ends, and with the books full (the cache
    holding the whole budget) those holes took RSS over the budget + interpreter + 32 MiB bound (a 64-token
    prefill of the peer checkpoint at half its experts: 39 MiB of them, 1.5-33 MB over the bound; docs/memory.md).
    After each layer, the anonymous RSS that lies both beyond the process's own when the engine opened plus the books
    and beyond what the step began with (RSS the step did not grow is not its holes: another engine's, or the
    caller's) is booked as unbooked memory, so experts make room before the next layer reads, never below `keep`
    bytes of expert room (a layer step's reads); the step's end gives it back. Bytes booked but not yet resident
    (reads in flight, scratch not yet touched) leave room rather than count."""

    GROW = 1 << 20  # books move by at least this much (no eviction for a page or two)

    def __init__(self, memory, idle: Callable[[], int], opened_anon: int, keep: int = 0):
        self.memory, self.idle, self.opened, self.keep = memory, idle, opened_anon, keep
        rss = anon_rss()
        self.start = rss - books_held(memory, idle) if rss else 0
        self.booked = False

    def layer_done(self) -> None:
        rss = anon_rss()
        if not rss or not self.opened:
            return
        beyond = rss - books_held(self.memory, self.idle)
        over = min(beyond - self.opened, beyond - self.start)
        if over > self.memory.unbooked_bytes + self.GROW:
            self.memory.set_unbooked(over, keep=self.keep)
            self.booked = True

    def done(self) -> None:
        if self.booked:
            self.memory.set_unbooked(0, keep=self.keep)
            self.booked = False


class ResidentCheck:
    """Before and after each engine step: the anonymous RSS grown since `start` beyond what the accountant books
    (plus the reader's idle expert buffers, which the cache's free room covers) is booked as unbooked memory, so
    experts make room for it, leaving them `keep` bytes (what a step needs to read its experts). Moves in steps of
    at least `grow_step` up and `shrink_step` down (no expert churn from small swings). The engine also measures
    after each layer of a step (`layer_done`): what the layers held beyond the books stays booked for the next steps
    (`held`), fading once they hold less, where a step's end alone would show the room free. Started by a server or
    batch scheduler, which owns the process's memory; an engine embedded beside other work does not measure (its
    neighbours' memory is not its own)."""

    def __init__(self, memory, idle: Callable[[], int], keep: int = 0, grow_step: int = 4 << 20,
                 shrink_step: int = 8 << 20):
        self.memory, self.idle, self.keep = memory, idle, keep
        self.grow_step, self.shrink_step = grow_step, shrink_step
        self.base = anon_rss() - self.books()  # the process beside the engine when the measuring starts
        self.held = 0  # RSS beyond the books at the last steps' layer ends (`layer_done`), fading `shrink_step` a step
        self._step_over = 0  # this step's so far

    def books(self) -> int:
        return books_held(self.memory, self.idle)

    def measure(self) -> None:
        """Book what RSS holds beyond the books now. The engine measures after a step and again before the next:
        sequences freed in between give their state's books back at once, and with them the share of RSS beyond the
        books that their books had covered while they were held (KV blocks were booked whole then; a sliding
        window's still are), so the next step's expert reads would fill the room that RSS beyond the books already
        holds; measured first, the cache makes room for it before reading (the 1,024-request job's wave ending at
        once: 62 MB over the bound without this)."""
        rss = anon_rss()
        if rss:
            self.memory.set_unbooked(max(rss - self.base - self.books(), self.held), self.grow_step,
                                     self.shrink_step, self.keep)

    def layer_done(self) -> None:
        """After each layer of a step: note the anonymous RSS beyond the books. A step on the step heap keeps its
        freed temporaries until it ends, and where its heap fragments (the 1,024-request fp32 batch-invariant job:
        its arena grew step after step, a step's layer ends 85 MiB beyond the books that the step's end no longer
        shows), the measurement at the step's end alone would let the cache fill that room again before the next."""
        rss = anon_rss()
        if rss:
            self._step_over = max(self._step_over, rss - self.base - self.books())

    def step_done(self) -> None:
        """The step is over: what its layer ends held beyond the books is booked from the next `measure` on (and by
        the measurements after it, fading `shrink_step` a step once later steps hold less)."""
        self.held, self._step_over = max(self._step_over, self.held - self.shrink_step, 0), 0
