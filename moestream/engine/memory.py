"""Memory accountant: one RAM budget for everything the engine keeps resident.

Owns the byte counts of dense weights, per-sequence state (KV cache, recurrent state), the expert cache and a
fixed compute scratch allowance, and the peak of their sum. It gives the expert cache its capacity (whatever
the budget leaves) and makes the cache shrink when state grows. It allocates nothing itself.
"""
from __future__ import annotations

from moestream.config import format_bytes
from moestream.errors import BudgetError
from moestream.experts.cache import ExpertCache

UNLIMITED = 1 << 62


class MemoryAccountant:
    def __init__(self, budget: int | None):
        self.budget = budget if budget is not None else UNLIMITED
        self.limited = budget is not None
        self.dense_bytes = 0
        self.state_bytes = 0
        self.scratch_bytes = 0
        self.cache: ExpertCache | None = None
        self.peak = 0

    def cache_capacity(self) -> int:
        return max(0, self.budget - self.dense_bytes - self.state_bytes - self.scratch_bytes)

    def resident(self) -> int:
        cached = self.cache.resident_bytes if self.cache is not None else 0
        return self.dense_bytes + self.state_bytes + self.scratch_bytes + cached

    def observe(self) -> None:
        r = self.resident()
        if r > self.peak:
            self.peak = r

    def add_dense(self, nbytes: int) -> None:
        self.dense_bytes += nbytes
        self.observe()

    def grow_state(self, nbytes: int, what: str = "sequence state") -> None:
        """Account `nbytes` more of state, evicting experts to make room; BudgetError if it cannot fit."""
        if nbytes > 0 and self.limited:
            if self.dense_bytes + self.state_bytes + self.scratch_bytes + nbytes > self.budget:
                raise BudgetError(
                    f"{what} needs {format_bytes(nbytes)} more, but the RAM budget of {format_bytes(self.budget)} "
                    f"is taken by dense weights ({format_bytes(self.dense_bytes)}) and existing state "
                    f"({format_bytes(self.state_bytes)}): raise --ram-budget or shorten the context"
                )
            self.state_bytes += nbytes
            if self.cache is not None:
                self.cache.shrink_to_capacity()
        else:
            self.state_bytes += nbytes
        self.observe()

    def release_state(self, nbytes: int) -> None:
        self.state_bytes -= nbytes
