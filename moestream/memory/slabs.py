"""Where KV / latent cache blocks live: page-aligned slots in large anonymous mappings, one pool per block size.

A cache block (64 rows: 32 KiB for a bf16 GQA layer of 4 x 128) is below glibc's mmap threshold, so from the heap
thousands of them, freed as sequences finish and interleaved with every other small allocation, fragmented it:
a 128-request batch job held 211 MB of free heap at its RSS peak, 150 MB over the budget's bound
(docs/performance.md). Here each block is a slot of a slab mapped once (private anonymous; transparent huge pages
off, so touching a slot maps only its own pages), and a block given back has its pages returned to the kernel at
once (MADV_DONTNEED), so resident cache memory is the live blocks' bytes, the same bytes the budget charges.
"""
from __future__ import annotations

import mmap
import threading

import torch

PAGE = mmap.PAGESIZE


def slot_bytes(nbytes: int) -> int:
    """Bytes of the slab slot that holds a block of `nbytes`: whole pages."""
    return -(-nbytes // PAGE) * PAGE
SLAB_BYTES = 64 << 20  # virtual: pages are mapped only when a slot is first written


class SlabPool:
    """Fixed-size slots of `slot_bytes` (a page multiple) carved from slabs of at least SLAB_BYTES each."""

    def __init__(self, nbytes: int):
        self.slot_bytes = slot_bytes(nbytes)
        self.per_slab = max(1, SLAB_BYTES // self.slot_bytes)
        self.slabs: list[mmap.mmap] = []
        self.free: list[tuple[int, int]] = []  # (slab, slot), most recently freed last
        self.where: dict[int, tuple[int, int]] = {}  # data_ptr of a slot given out -> (slab, slot)
        self.lock = threading.Lock()

    def _grow(self) -> None:
        mm = mmap.mmap(-1, self.per_slab * self.slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # a 2 MiB huge page would make one 32 KiB block cost 2 MiB
            mm.madvise(mmap.MADV_NOHUGEPAGE)
        self.slabs.append(mm)
        s = len(self.slabs) - 1
        self.free.extend((s, i) for i in reversed(range(self.per_slab)))

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes` (<= slot_bytes) on a fresh slot (its pages zero or not yet mapped)."""
        with self.lock:
            if not self.free:
                self._grow()
            s, i = self.free.pop()
            t = torch.frombuffer(self.slabs[s], dtype=torch.uint8, count=nbytes, offset=i * self.slot_bytes)
            self.where[t.data_ptr()] = (s, i)
        return t

    def give(self, t: torch.Tensor) -> None:
        """Return the slot holding `t` (a view from take): its pages go back to the kernel now."""
        with self.lock:
            s, i = self.where.pop(t.data_ptr())
            self.slabs[s].madvise(mmap.MADV_DONTNEED, i * self.slot_bytes, self.slot_bytes)
            self.free.append((s, i))

    @property
    def slots_out(self) -> int:
        return len(self.where)


_pools: dict[int, SlabPool] = {}
_pools_lock = threading.Lock()


def _pool(nbytes: int) -> SlabPool:
    key = slot_bytes(nbytes)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = SlabPool(key)
        return _pools[key]


def new_block(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor for one cache block, on a slab slot (give it back with `free_block`)."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * dtype.itemsize
    return _pool(nbytes).take(nbytes).view(dtype).view(shape)


def free_block(t: torch.Tensor) -> None:
    """Give back a block from `new_block`; its contents are gone (the pages read as zeros if touched again)."""
    _pool(t.numel() * t.element_size()).give(t)


def blocks_out() -> int:
    """Cache blocks given out and not yet freed, over every pool (tests check that released state frees them)."""
    with _pools_lock:
        return sum(p.slots_out for p in _pools.values())
