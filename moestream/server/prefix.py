"""Prefix reuse: saved sequence states keyed by the tokens they hold, cloned into new requests that extend them.

Owns `clone_state` (a deep copy of a `SeqState`, every block re-accounted in the budget, optionally cut back to a
shorter prefix when the state is only KV rows), `PrefixCache` (LRU under a byte limit) and `StateProfile`, which
replays the KV blocks' allocation to predict a sequence's state and the bytes a step will add (so admission and
saved-prefix eviction happen before the budget runs out).
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable

from moestream.memory.accountant import MemoryAccountant
from moestream.memory.state import (BLOCK_TOKENS, BlockBuffer, BlockLayout, SeqState, block_layout, block_shape,
                                    blocks_held)


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "clone") and hasattr(x, "numel")  # a torch.Tensor, without importing torch here


def _walk(slot: Any, on_buffer: Callable[[BlockBuffer], Any], on_tensor: Callable[[Any], Any]) -> Any:
    """Rebuild a per-layer slot, mapping its BlockBuffers and tensors; immutable values are shared."""
    if isinstance(slot, BlockBuffer):
        return on_buffer(slot)
    if _is_tensor(slot):
        return on_tensor(slot)
    if isinstance(slot, list):
        return [_walk(s, on_buffer, on_tensor) for s in slot]
    if isinstance(slot, tuple):
        return tuple(_walk(s, on_buffer, on_tensor) for s in slot)
    if isinstance(slot, dict):
        return {k: _walk(v, on_buffer, on_tensor) for k, v in slot.items()}
    if slot is None or isinstance(slot, (bool, int, float, str, bytes, MemoryAccountant, type)):
        return slot
    if hasattr(slot, "__dict__"):
        new = copy.copy(slot)
        for k, v in vars(slot).items():
            setattr(new, k, _walk(v, on_buffer, on_tensor))
        return new
    raise TypeError(f"cannot clone sequence state holding a {type(slot).__name__}")  # never share mutable state


def _leaves(slot: Any) -> list[Any]:
    """The BlockBuffers and tensors inside a slot, in order, without copying anything."""
    if isinstance(slot, BlockBuffer) or _is_tensor(slot):
        return [slot]
    if isinstance(slot, (list, tuple)):
        return [x for s in slot for x in _leaves(s)]
    if isinstance(slot, dict):
        return [x for s in slot.values() for x in _leaves(s)]
    if hasattr(slot, "__dict__") and not isinstance(slot, (MemoryAccountant, type)):
        return [x for s in vars(slot).values() for x in _leaves(s)]
    return []


def buffers(state: SeqState) -> list[BlockBuffer]:
    return [x for x in _leaves(state.layers) if isinstance(x, BlockBuffer)]


def held_buffers(state: SeqState) -> list[BlockBuffer]:
    """`buffers(state)`, remembered on the state (`derived`) until a layer slot is made or the slots are dropped
    (`slots_made`; a slot keeps its buffers): a step's growth check asks for a thousand sequences' buffers a step."""
    got = state.derived
    if got is None or got[0] != state.slots_made:
        got = state.derived = (state.slots_made, buffers(state))
    return got[1]


def truncatable(state: SeqState) -> bool:
    """Only KV rows (no recurrent matrices, no fixed state) can be cut back to a shorter prefix."""
    leaves = _leaves(state.layers)
    return (state.fixed_bytes == 0 and all(isinstance(x, BlockBuffer) for x in leaves)
            and all(b.length == state.pos and b.start == 0 for b in leaves))  # a window's dropped rows are gone


def state_bytes(state: SeqState) -> int:
    return sum(b.nbytes for b in buffers(state)) + state.fixed_bytes + state.host_bytes


def clone_state(state: SeqState, upto: int | None = None) -> SeqState:
    """A deep copy holding the first `upto` tokens (default all). BudgetError if the budget cannot hold it."""
    n = state.pos if upto is None else upto
    if n != state.pos and not truncatable(state):
        raise ValueError("only a KV-only state can be cloned at a shorter length")
    keep = None if upto is None else n  # rows to copy from each buffer
    total = sum(b.clone_bytes(keep) for b in buffers(state)) + state.fixed_bytes + state.host_bytes
    state.memory.grow_state(total, "a reused prefix")
    try:
        layers = _walk(state.layers, lambda b: b.clone(keep), lambda t: t.clone())
    except BaseException:
        state.memory.release_state(total)
        raise
    return SeqState(state.memory, state.num_layers, pos=n, layers=layers, fixed_bytes=state.fixed_bytes,
                    host_bytes=state.host_bytes, kv_dtype=state.kv_dtype)


def peak_blocks(prompt: int, context: int, chunk: int, window: int | None = None, block: int = BLOCK_TOKENS) -> int:
    """The most blocks one BlockBuffer holds while its sequence is fed the prompt `chunk` rows at a time, then one
    row per decoded token up to `context` (its trim and growth replayed). Without a window that is the end; with
    one, the count is periodic once the window is full, so the decode replay stops after a window and two blocks."""
    peak = length = 0
    while length < min(prompt, context):
        n = min(max(1, chunk), prompt - length)
        peak = max(peak, blocks_held(length, n, window, block))
        length += n
    if window is None:
        return max(peak, blocks_held(0, context, None, block)) if context > length else peak
    stop = min(context, length + window + 2 * block)
    while length < stop:
        peak = max(peak, blocks_held(length, 1, window, block))
        length += 1
    return peak


def rows_at(prompt: int, context: int, chunk: int) -> int:
    """Rows of KV blocks a full-attention cache holds once a sequence reaches `context` tokens."""
    return peak_blocks(prompt, context, chunk) * BLOCK_TOKENS


class StateProfile:
    """What a fresh sequence's state will look like, learned from the first sequence that has state."""

    def __init__(self) -> None:
        # per buffer: its window and where its rows lie (BlockLayout: block rows, the charge of its pages and blocks)
        self.shapes: list[tuple[int | None, BlockLayout]] | None = None
        self.fixed = 0

    def learn(self, state: SeqState) -> None:
        if self.shapes is None and state.pos > 0:
            self.shapes = [(b.window, b.layout) for b in buffers(state)]
            self.fixed = state.fixed_bytes + state.host_bytes

    @classmethod
    def of_rows(cls, row_bytes: list[int], fixed: int, bits: int = 0) -> "StateProfile":
        """A profile known ahead of any sequence: one full-context buffer per entry of `row_bytes` (bytes per
        token), in the engine's blocks (memory/state.py block_shape; int8 / int4 rows with their scales when
        `bits` is 8 / 4), plus `fixed` bytes (the planner's state from a config alone). Its layouts take a row as
        one region (a quantised row's scales and values together): the planner asks for `reserve`, whole blocks."""
        prof = cls()
        prof.shapes = []
        for row in row_bytes:
            rows, nbytes = block_shape(row, bits)
            prof.shapes.append((None, block_layout(rows, nbytes, ((0, row),))))
        prof.fixed = fixed
        return prof

    @property
    def known(self) -> bool:
        return self.shapes is not None

    def reserve(self, prompt: int, context: int, chunk: int) -> int:
        """Bytes reserved for one sequence's state up to `context` tokens when its `prompt` is fed `chunk` tokens at a
        time and the rest one by one, plus its fixed state: its buffers' blocks at their peak, charged whole (what
        they charge once full, and no less than the pages they charge before). 0 before anything is learned."""
        if self.shapes is None:
            return 0
        return sum(lay.whole * peak_blocks(prompt, context, chunk, w, lay.block)
                   for w, lay in self.shapes) + self.fixed

    def growth(self, state: SeqState, n: int) -> int:
        """Bytes appending `n` rows to `state` will charge: its buffers' new pages (blocks with a window), or for a
        fresh sequence what the learned buffers charge for `n` rows, plus its fixed state."""
        if state.pos > 0:
            return sum(b.growth(n) for b in held_buffers(state))
        if self.shapes is None:
            return 0  # nothing learned yet: no state exists, so nothing saved can be evicted either
        return sum(lay.charge_at(n) if w is None else lay.whole * blocks_held(0, n, w, lay.block)
                   for w, lay in self.shapes) + self.fixed


def _common_prefix(a: list[int], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Saved states keyed by the exact tokens they hold, evicted least recently used beyond `limit` bytes."""

    def __init__(self, limit: int, min_reuse: int = 1):
        self.limit = limit
        self.min_reuse = min_reuse
        self.entries: OrderedDict[tuple[int, ...], tuple[SeqState, int]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.reused_tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def _usable(self, key: tuple[int, ...], state: SeqState, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` this entry can supply (at least one token is left to compute)."""
        n = _common_prefix(tokens, key)
        n = min(n, len(tokens) - 1)
        if n < len(key) and not truncatable(state):
            return 0
        return n

    def lookup(self, tokens: list[int]) -> tuple[SeqState, int] | None:
        """A clone of the saved state sharing the longest prefix with `tokens`, or None."""
        best, best_n = None, 0
        for key, (state, _) in self.entries.items():
            n = self._usable(key, state, tokens)
            if n > best_n:
                best, best_n = key, n
        if best is None or best_n < self.min_reuse:
            return None
        self.entries.move_to_end(best)
        state = self.entries[best][0]
        clone = clone_state(state, best_n)
        self.hits += 1
        self.reused_tokens += best_n
        return clone, best_n

    def save(self, tokens: list[int], state: SeqState) -> None:
        """Take ownership of `state` (holding exactly `tokens`); frees it when it cannot be kept."""
        key = tuple(tokens)
        nbytes = state_bytes(state)
        if key in self.entries or nbytes > self.limit or not key:
            state.release()
            if key in self.entries:
                self.entries.move_to_end(key)
            return
        self.entries[key] = (state, nbytes)
        self.bytes += nbytes
        while self.bytes > self.limit:
            self.evict_one()

    def evict_one(self) -> bool:
        if not self.entries:
            return False
        _, (state, nbytes) = self.entries.popitem(last=False)
        state.release()
        self.bytes -= nbytes
        self.evictions += 1
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass
