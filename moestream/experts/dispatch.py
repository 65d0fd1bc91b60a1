"""Routed-expert execution: fetch the union of experts a layer step needs through the cache, run each once.

Owns the order of work in one MoE layer step (cached experts first, then misses read in parallel waves that
fit the budget), the combine in fp32, and the expert statistics. The family supplies the router output and a
function computing one expert from its tensors; this module never parses weight names.
"""
from __future__ import annotations

from typing import Callable

import torch

from moestream.config import format_bytes
from moestream.engine.memory import MemoryAccountant
from moestream.errors import BudgetError
from moestream.experts.cache import ExpertCache
from moestream.experts.store import ExpertBlob, ExpertStore

ExpertFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


class ExpertRunner:
    def __init__(self, store: ExpertStore, memory: MemoryAccountant, policy: str = "lru"):
        self.store = store
        self.memory = memory
        self.cache = ExpertCache(memory.cache_capacity, policy)
        memory.cache = self.cache

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fn: ExpertFn,
            out_dim: int | None = None) -> torch.Tensor:
        """x [T, H]; ids, weights [T, k]. Returns sum_j weights[t, j] * fn(x[t], expert ids[t, j]) as fp32 [T, D]."""
        out = torch.zeros(x.shape[0], out_dim or x.shape[1], dtype=torch.float32)
        uniq = torch.unique(ids).tolist()
        hits = [e for e in uniq if (layer, e) in self.cache]
        misses = [e for e in uniq if (layer, e) not in self.cache]
        for e in hits:
            self.cache.stats.record(layer, True)
            self._apply(out, x, ids, weights, e, self.cache.get((layer, e)), fn)
        pending = list(misses)
        while pending:
            wave = self._next_wave(layer, pending)
            blobs = self.store.read_many([(layer, e) for e in wave])
            for e, blob in zip(wave, blobs):
                self.cache.stats.record(layer, False)
                self.cache.put((layer, e), blob, blob.nbytes, keep=frozenset((layer, p) for p in pending))
                self.memory.observe()
                self._apply(out, x, ids, weights, e, blob, fn)
            pending = pending[len(wave):]
        return out

    def _next_wave(self, layer: int, pending: list[int]) -> list[int]:
        """The longest prefix of `pending` whose bytes fit in the cache at once (at least one expert)."""
        wave, total = [], 0
        for e in pending:
            nbytes = self.store.expert_nbytes(layer, e)
            if wave and not self.cache.make_room(total + nbytes):
                break
            total += nbytes
            wave.append(e)
        if not self.cache.make_room(total):
            raise BudgetError(
                f"the RAM budget leaves {format_bytes(self.memory.cache_capacity())} for experts, less than one "
                f"expert ({format_bytes(total)}): raise --ram-budget"
            )
        return wave

    @staticmethod
    def _apply(out: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, e: int,
               blob: ExpertBlob, fn: ExpertFn) -> None:
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        y = fn(x[rows], blob.tensors()).float()  # [n, D]
        out.index_add_(0, rows, y * weights[rows, slots].unsqueeze(-1).float())
