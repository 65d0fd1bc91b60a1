"""The C heap's behaviour under a RAM budget: big temporaries go back to the OS when freed.

Owns one process-wide setting. glibc keeps freed memory in its heap and, by default, raises its mmap threshold
each time a large block is freed, so later megabyte-sized temporaries (torch activations, upcast slabs) are
carved from the heap and the heap's high-water mark stays resident: measured on a medium synthetic model, 45-55
MB of RSS beyond everything the budget accounts for, growing during decode. A fixed mmap threshold sends every
block above it to its own mapping (returned on free); a trim threshold returns the heap's free top beyond a
fixed 1 MiB. With both, RSS stays within the accounted bytes plus the interpreter's own (docs/performance.md).
A zero trim threshold had the same peak RSS but gave the top back after nearly every free, and took it again on
the next allocation: a warm decode step of the medium model was 8-25% slower.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 10
TRIM_THRESHOLD_BYTES = 1 << 20

_done: bool | None = None


def return_freed_memory() -> bool:
    """Configure glibc's malloc once per process (no-op elsewhere, or with MOESTREAM_MALLOC_TUNING=0, the
    switch for A/B runs). True when the setting is in force."""
    global _done
    if _done is None:
        _done = False
        if sys.platform.startswith("linux") and os.environ.get("MOESTREAM_MALLOC_TUNING", "1") != "0":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):  # not glibc (musl has no mallopt)
                return False
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) \
                and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    return _done
