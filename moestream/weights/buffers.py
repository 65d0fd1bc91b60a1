"""Copies of fetched byte ranges that do not hold the GIL over their bytes, and page-aligned buffers for them.

Owns `copy_into(dst, src)`: a memcpy that releases the GIL for large ranges. The decode thread shares the GIL with
every fetching and writing thread; a slice copy holds it for the whole copy, and on a loaded machine a thread that
is descheduled in the middle of a 3 MiB copy (page faults of a fresh buffer included: ~10 us each on this VM)
keeps the decode's compute waiting behind it. And `aligned(n)`: page-aligned buffers, what the SSD
tier's O_DIRECT writes take their bytes from; `POOL` recycles those the fetch-ahead and the write-behind hand to the
tier's writer (`Lease`: back in the pool when the last holder lets go), so their pages are not faulted in afresh
for every range (on this VM a fresh page cost ~6 us: ~2 ms of CPU per MB fetched, against ~0.15 to copy it).
"""
from __future__ import annotations

import mmap
import threading
import warnings

import torch

SMALL = 1 << 16  # below this a plain slice copy costs less than handing the copy to torch
POOL_KEEP = 32 << 20  # bytes of free buffers the pool keeps (outside the RAM budget, like the fills in flight)
POOL_GRAIN = 1 << 20  # pooled buffers are whole multiples of this (a request of n bytes takes one of n rounded up)


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
    # private: mmap's default for anonymous memory is a shared mapping, whose pages come from shmem (a page-cache
    # lookup and a shmem folio per fault, freed through it again): 1.2-1.5x the CPU per fresh page here
    return memoryview(mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE))


class Lease:
    """A pooled page-aligned buffer (`view`: its first n bytes) with a count of holders: whoever takes it holds
    it; `hold()` adds a holder (a queued write, a reader copying from it), `release()` drops one, and the last
    release gives the buffer back to the pool. Nobody may touch `view` after releasing its hold."""

    __slots__ = ("view", "_buf", "_pool", "_n")

    def __init__(self, pool: Pool, buf: mmap.mmap, n: int):
        self._pool, self._buf, self._n = pool, buf, 1
        self.view = memoryview(buf)[:n]

    def hold(self) -> None:
        with self._pool.lock:
            if self._n <= 0:
                raise RuntimeError("hold of a released buffer")
            self._n += 1

    def release(self) -> None:
        with self._pool.lock:
            self._n -= 1
            if self._n > 0:
                return
            if self._n < 0:
                raise RuntimeError("buffer released more often than held")
        buf, self._buf = self._buf, None
        self._pool._give(buf)


class Pool:
    """Free page-aligned buffers by size (multiples of POOL_GRAIN), at most `keep` bytes of them."""

    def __init__(self, keep: int = POOL_KEEP):
        self.keep = keep
        self.lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self._free_bytes = 0
        self.taken = 0  # buffers handed out
        self.reused = 0  # ... of them from the free lists (the rest mapped afresh)

    def take(self, n: int) -> Lease:
        """A buffer of at least `n` bytes, held once by the caller."""
        size = max(POOL_GRAIN, -(-n // POOL_GRAIN) * POOL_GRAIN)
        with self.lock:
            self.taken += 1
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= size
                self.reused += 1
        if buf is None:
            buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        return Lease(self, buf, n)

    def _give(self, buf: mmap.mmap) -> None:
        with self.lock:
            if self._free_bytes + len(buf) <= self.keep:
                self._free.setdefault(len(buf), []).append(buf)
                self._free_bytes += len(buf)
                return
        # over what the pool keeps: dropped, its pages go back to the kernel with the last view of it


POOL = Pool()


def pooled_copy(src: memoryview) -> Lease:
    """A private, page-aligned copy of `src` in a pooled buffer, held once by the caller (for a writer thread to
    keep while the caller reuses its own buffer)."""
    lease = POOL.take(len(src))
    copy_into(lease.view, src)
    return lease
