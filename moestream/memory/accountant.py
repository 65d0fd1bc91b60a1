"""Memory accountant: one RAM budget for everything the engine keeps resident.

Owns the byte counts of resident dense weights, streamed dense weights in RAM right now (inside a reserve the
residency plan sets aside for its double buffers), per-sequence state (KV cache, recurrent state), the expert
cache and a fixed compute scratch allowance, the process memory measured resident outside those books
(`set_unbooked`, engine/allocator.py's `ResidentCheck`), and the peak of their sum. It gives the expert cache its
capacity (whatever the budget leaves) and makes the cache shrink when state or unbooked memory grows. It
allocates nothing itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from moestream.config import format_bytes
from moestream.errors import BudgetError

if TYPE_CHECKING:  # a type only: the accountant sits below experts/ (docs/ARCHITECTURE.md)
    from moestream.experts.cache import ExpertCache

UNLIMITED = 1 << 62


class MemoryAccountant:
    def __init__(self, budget: int | None):
        self.budget = budget if budget is not None else UNLIMITED
        self.limited = budget is not None
        self.dense_bytes = 0
        self.state_bytes = 0
        self.scratch_bytes = 0
        self.stream_reserve = 0  # the residency plan's stream buffers: never given to the expert cache
        self.stream_bytes = 0  # streamed dense bytes in RAM right now (at most stream_reserve)
        self.streamer = None  # the engine's DenseStreamer when some dense weights stream (DenseWeights asks it)
        self.cache: ExpertCache | None = None
        # resident memory the books above do not see (freed heap the allocators keep, ...), as last measured: it
        # displaces experts only, never state (grow_state may take it back; the next measurement sets it again)
        self.unbooked_bytes = 0
        self.unbooked_keep = 0  # cache room unbooked memory never takes (what a step needs to read its experts)
        self.peak = 0

    def cache_capacity(self) -> int:
        return max(0, self.budget - self.fixed() - self.state_bytes - self.unbooked_bytes)

    def fixed(self) -> int:
        """Bytes the budget holds before any state or expert: resident dense, compute scratch, stream buffers."""
        return self.dense_bytes + self.scratch_bytes + self.stream_reserve

    def resident(self) -> int:
        cached = self.cache.resident_bytes if self.cache is not None else 0
        return (self.dense_bytes + self.state_bytes + self.scratch_bytes + self.stream_bytes + cached
                + self.unbooked_bytes)

    def set_unbooked(self, nbytes: int, grow_step: int = 0, shrink_step: int = 0, keep: int = 0) -> None:
        """Book `nbytes` of measured resident memory outside the books, within what state leaves less `keep`
        bytes of expert room (experts are evicted to make room). It moves only when the measurement is more than
        `grow_step` above or `shrink_step` below the current figure, so small swings do not evict and re-read
        experts every step."""
        if not self.limited:
            return
        self.unbooked_keep = keep
        nbytes = max(0, min(nbytes, self._unbooked_room()))
        if nbytes > self.unbooked_bytes + grow_step or nbytes < self.unbooked_bytes - shrink_step:
            self.unbooked_bytes = nbytes
            if self.cache is not None:
                self.cache.shrink_to_capacity()
            self.observe()

    def _unbooked_room(self) -> int:
        return max(0, self.budget - self.fixed() - self.state_bytes - self.unbooked_keep)

    def observe(self) -> None:
        r = self.resident()
        if r > self.peak:
            self.peak = r

    def add_dense(self, nbytes: int) -> None:
        self.dense_bytes += nbytes
        self.observe()

    def add_stream(self, nbytes: int) -> None:
        """A streamed dense read is starting: its bytes count until `release_stream`."""
        self.stream_bytes += nbytes
        if self.limited and self.stream_bytes > self.stream_reserve:
            raise BudgetError(f"internal: streamed dense weights in RAM ({self.stream_bytes} bytes) exceed the "
                              f"reserve the residency plan set aside ({self.stream_reserve} bytes)")
        self.observe()

    def release_stream(self, nbytes: int) -> None:
        self.stream_bytes -= nbytes

    def grow_state(self, nbytes: int, what: str = "sequence state") -> None:
        """Account `nbytes` more of state, evicting experts to make room; BudgetError if it cannot fit."""
        if nbytes > 0 and self.limited:
            if self.fixed() + self.state_bytes + nbytes > self.budget:
                raise BudgetError(
                    f"{what} needs {format_bytes(nbytes)} more, but the RAM budget of {format_bytes(self.budget)} "
                    f"is taken by dense weights ({format_bytes(self.dense_bytes)} resident, "
                    f"{format_bytes(self.stream_reserve)} of stream buffers) and existing state "
                    f"({format_bytes(self.state_bytes)}): raise --ram-budget or shorten the context"
                )
            self.state_bytes += nbytes
            # state never fails for unbooked memory: it gives up room (re-measured after the step)
            self.unbooked_bytes = min(self.unbooked_bytes, self._unbooked_room())
            if self.cache is not None:
                self.cache.shrink_to_capacity()
        else:
            self.state_bytes += nbytes
        self.observe()

    def release_state(self, nbytes: int) -> None:
        self.state_bytes -= nbytes
