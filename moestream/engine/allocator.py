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
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import time

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


def return_freed_memory() -> bool:
    """Configure glibc's malloc once per process (no-op elsewhere, or with MOESTREAM_MALLOC_TUNING=0, the
    switch for A/B runs). True when the setting is in force."""
    global _done
    if _done is None:
        _done = False
        if sys.platform.startswith("linux") and os.environ.get("MOESTREAM_MALLOC_TUNING", "1") != "0":
            mallopt = _libc_fn("mallopt", [ctypes.c_int, ctypes.c_int])
            if mallopt is None:  # not glibc (musl has no mallopt)
                return False
            _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) \
                and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _done


_TRIM = _libc_fn("malloc_trim", [ctypes.c_size_t])


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
