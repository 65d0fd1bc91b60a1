"""Copies of fetched byte ranges that do not hold the GIL over their bytes, and page-aligned buffers for them.

Owns `copy_into(dst, src)`: a memcpy that releases the GIL for large ranges. The decode thread shares the GIL with
every fetching and writing thread; a slice copy holds it for the whole copy, and on a loaded machine a thread that
is descheduled in the middle of a 3 MiB copy (page faults of a fresh buffer included: ~10 us each on this VM)
keeps the decode's compute waiting behind it. And `aligned(n)` / `copy_of(src)`: page-aligned buffers, what the SSD
tier's O_DIRECT writes take their bytes from.
"""
from __future__ import annotations

import mmap
import warnings

import torch

SMALL = 1 << 16  # below this a plain slice copy costs less than handing the copy to torch


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
