"""Copies of fetched byte ranges that do not hold the GIL over their bytes, and the background threads' priority.

Owns `copy_into(dst, src)`: a memcpy that releases the GIL for large ranges. The decode thread shares the GIL with
every fetching and writing thread; a slice copy holds it for the whole copy, and on a loaded machine a thread that
is descheduled in the middle of a 3 MiB copy (page faults of a fresh buffer included: ~10 us each on this VM)
keeps the decode's compute waiting behind it. And `background()`: a thread whose work the decode does not wait for
(the fetch-ahead's guesses, the SSD tier's write-behind) lowers its own scheduling priority by BACKGROUND_NICE.
"""
from __future__ import annotations

import mmap
import os
import threading
import warnings

import torch

SMALL = 1 << 16  # below this a plain slice copy costs less than handing the copy to torch
# nice increment of background threads (0: none). On the 2-core VM a cold decode's compute thread spent as long
# waiting for a CPU as computing (0.13-0.23 s per token each), behind ~0.65 s of fetching threads' CPU per token;
# but increments of 5, 10 and 19 left that wait (0.17-0.20 s) and the cold speed where they were (locked A/B,
# 0.54-0.61 of the link bound against 0.53-0.61 at 0: docs/performance.md), so it is off by default
BACKGROUND_NICE = 0


def background() -> None:
    """Lower the calling thread's priority by BACKGROUND_NICE (Linux: nice is per thread); never fails."""
    if BACKGROUND_NICE:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
        except (AttributeError, OSError):  # not Linux, or not allowed: full priority
            pass


def copy_into(dst: memoryview, src: memoryview | bytes | bytearray) -> None:
    """dst[:] = src (equal lengths), the GIL released for large writable ranges."""
    src = memoryview(src)
    if len(src) != len(dst):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    if len(src) < SMALL or src.readonly or dst.readonly or src.format != "B" or dst.format != "B":
        dst[:] = src
        return
    with warnings.catch_warnings():  # frombuffer warns about buffers it cannot prove writable; both are
        warnings.simplefilter("ignore")
        torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))


def aligned(n: int) -> memoryview:
    """A writable buffer of `n` bytes starting on a page boundary (anonymous memory, freed with its last view):
    what an O_DIRECT write of the SSD tier takes its bytes from."""
    if n <= 0:
        return memoryview(bytearray(0))
    return memoryview(mmap.mmap(-1, n))


def copy_of(src: memoryview) -> memoryview:
    """A private, page-aligned copy of `src` (for a writer thread to keep while the caller reuses its buffer)."""
    out = aligned(len(src))  # fresh pages cost their faults inside the copy, the GIL released
    copy_into(out, src)
    return out
