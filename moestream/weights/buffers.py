"""Copies of fetched byte ranges that do not hold the GIL over their bytes.

Owns `copy_into(dst, src)`: a memcpy that releases the GIL for large ranges. The decode thread shares the GIL with
every fetching and writing thread; a slice copy holds it for the whole copy, and on a loaded machine a thread that
is descheduled in the middle of a 3 MiB copy (page faults of a fresh buffer included: ~10 us each on this VM)
keeps the decode's compute waiting behind it.
"""
from __future__ import annotations

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


def copy_of(src: memoryview) -> bytearray:
    """A private copy of `src` (for a writer thread to keep while the caller reuses its buffer)."""
    out = bytearray(len(src))  # calloc: fresh pages cost their faults inside the copy, the GIL released
    copy_into(memoryview(out), src)
    return out
