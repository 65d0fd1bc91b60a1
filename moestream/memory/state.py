"""Per-sequence state and the batch layout one engine step works on.

Owns `SeqState` (one slot per layer for KV caches or recurrent state, the token count) and the growable,
budget-accounted tensors that hold KV caches. Models create their per-layer state lazily through `slot()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moestream.memory.accountant import MemoryAccountant

GROW_TOKENS = 64  # small steps: a batch of short sequences holds ~its context, not 256 rows each


class GrowingBuffer:
    """A [L, *shape] fp32 tensor appended along dim 0, grown in chunks; every allocated byte is accounted."""

    def __init__(self, memory: MemoryAccountant, row_shape: tuple[int, ...], what: str = "KV cache",
                 dtype: torch.dtype = torch.float32):
        self.memory = memory
        self.row_shape = row_shape
        self.what = what
        self.dtype = dtype
        self.data = torch.empty((0, *row_shape), dtype=dtype)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Append rows [n, *shape]; returns the whole filled view [length, *shape]."""
        need = self.length + rows.shape[0]
        if need > self.data.shape[0]:
            cap = max(need, self.data.shape[0] + GROW_TOKENS, self.data.shape[0] * 5 // 4)
            extra = (cap - self.data.shape[0]) * rows[0].numel() * self.data.element_size()
            self.memory.grow_state(extra, self.what)
            new = torch.empty((cap, *self.row_shape), dtype=self.dtype)
            new[: self.length] = self.data[: self.length]
            self.data = new
        self.data[self.length:need] = rows
        self.length = need
        return self.data[:need]

    def view(self) -> torch.Tensor:
        return self.data[: self.length]

    def release(self) -> None:
        self.memory.release_state(self.nbytes)
        self.data = torch.empty((0, *self.row_shape), dtype=self.dtype)
        self.length = 0


@dataclass
class SeqState:
    """Everything one sequence carries between steps."""

    memory: MemoryAccountant
    num_layers: int
    pos: int = 0  # tokens already processed
    layers: list[Any] = field(default_factory=list)
    fixed_bytes: int = 0  # accounted fixed-size state (recurrent matrices, conv windows)

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = [None] * self.num_layers

    def slot(self, layer: int, factory: Callable[[], Any]) -> Any:
        if self.layers[layer] is None:
            self.layers[layer] = factory()
        return self.layers[layer]

    def account_fixed(self, nbytes: int, what: str = "recurrent state") -> None:
        self.memory.grow_state(nbytes, what)
        self.fixed_bytes += nbytes

    def release(self) -> None:
        for s in self.layers:
            for buf in _buffers(s):
                buf.release()
        self.memory.release_state(self.fixed_bytes)
        self.fixed_bytes = 0
        self.layers = [None] * self.num_layers
        self.pos = 0


def _buffers(slot: Any) -> list[GrowingBuffer]:
    if isinstance(slot, GrowingBuffer):
        return [slot]
    if isinstance(slot, (list, tuple)):
        return [b for s in slot for b in _buffers(s)]
    if isinstance(slot, dict):
        return [b for s in slot.values() for b in _buffers(s)]
    return [v for v in vars(slot).values() if isinstance(v, GrowingBuffer)] if hasattr(slot, "__dict__") else []


@dataclass
class Segment:
    """Rows [start, start + length) of a flat batch belong to `state`, at positions pos .. pos + length - 1."""

    state: SeqState
    start: int
    length: int
    pos: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


@dataclass
class Batch:
    segments: list[Segment]
    positions: torch.Tensor  # [T] long

    @classmethod
    def build(cls, items: list[tuple[SeqState, int]]) -> "Batch":
        segs, pos, start = [], [], 0
        for state, n in items:
            segs.append(Segment(state, start, n, state.pos))
            pos.append(torch.arange(state.pos, state.pos + n))
            start += n
        return cls(segs, torch.cat(pos))
