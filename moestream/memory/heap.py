"""Heap memory freed by a step's temporaries, given back to the kernel.

glibc keeps what large steps free (activations, gathered rows, kernel scratch) in its arenas for reuse; after a batch
job's prefill and mixed steps that was 75 MB of free heap (`mallinfo2().fordblks`) resident beyond the budget.
`HeapTrim.after_step` calls malloc_trim(0) after a step, at most once per `every_s` seconds (a 1-4 ms call: a batch
step of seconds pays it each time, a 60 ms decode step once in many). A no-op where libc has no malloc_trim.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time


def _trim_fn():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _trim_fn()


class HeapTrim:
    def __init__(self, every_s: float = 1.0):
        self.every_s, self.last, self.calls = every_s, time.monotonic(), 0

    def after_step(self) -> None:
        now = time.monotonic()
        if _TRIM is None or now - self.last < self.every_s:
            return
        _TRIM(0)
        self.last, self.calls = time.monotonic(), self.calls + 1


def available() -> bool:
    return _TRIM is not None
