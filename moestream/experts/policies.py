"""Eviction policies for the expert cache: LRU, frequency-weighted recency, and learned, persisted heat.

A policy only orders keys for eviction: `insert` (new entry), `touch` (hit; `touch_many` for a step's hits), `remove`
(gone), `victims()` (best candidates first). It never sees bytes, I/O or torch. Keys are (layer, expert) tuples;
`heat` persists its per-expert counts as JSON between runs and keeps the hottest experts (a fixed share of the
cache) last in line.
"""
from __future__ import annotations

import heapq
import itertools
import json
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Hashable, Iterator

Key = Hashable


class _Touches:
    """`touch_many`: a step's hits (ExpertCache.hits) as `touch` of each key in turn, for every policy."""

    def touch(self, key: Key) -> None:
        raise NotImplementedError

    def touch_many(self, keys: list[Key]) -> None:
        for key in keys:
            self.touch(key)


class LRUPolicy(_Touches):
    """Least recently used: evict the entry touched longest ago."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
        self.touch(key)

    def touch(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Key]:
        return iter(list(self._order))


class FrequencyRecencyPolicy(_Touches):
    """Exponentially decayed access count: score = sum over accesses of 2^-(age / half_life).

    Age is counted in engine steps for (layer, expert) keys (a step starts when the layer index goes down, so a
    decoded token is one step whatever the model's depth and top-k) and in accesses for any other key. Evicts
    the lowest score. Decay is global, so ordering by log(score) + t * ln2 / half_life (fixed between a key's
    accesses) is the same as ordering by current score: a heap with lazy deletion gives O(log n) updates.
    New priorities wait in a list until `victims()` next runs (or the heap is compacted): a warm decode touches
    a few experts every layer and evicts nothing, and a push into the heap, after a layer's expert bytes have
    streamed through the caches, cost several microseconds a touch. The order of victims is the same.
    A step's touches (`touch_many`) wait one step further, as keys in a log, played in order before any other
    call reads or changes the scores, or once the log holds LOG_MAX keys: scored a layer at a time between the
    experts' streams, the policy's dicts were out of the CPU's caches and a touch cost 2-2.5 us of a warm decode
    token; played together, under 1 us. The state after playing is the state touching key by key gives.
    """

    LOG_MAX = 4096  # touches a log holds before it is played

    name = "lfru"

    def __init__(self, half_life: float = 16.0) -> None:
        self.rate = math.log(2) / half_life
        self._t = 0
        self._last_layer: int | None = None
        self._score: dict[Key, tuple[float, int]] = {}  # key -> (score at last access, time of last access)
        self._heap: list[tuple[float, int, Key]] = []
        self._pending: list[tuple[float, int, Key]] = []  # entries not yet in the heap, in the order made
        self._seq = itertools.count()
        self._prio: dict[Key, float] = {}
        self._log: list[Key] = []  # touches not yet scored, in order (touch_many)

    def _bump(self, key: Key) -> None:
        if self._log:
            self._play()
        self._score_keys((key,))

    def insert(self, key: Key) -> None:
        # a re-read expert keeps part of its history: frequency across evictions is the point of the policy
        self._bump(key)

    def touch(self, key: Key) -> None:
        self._bump(key)

    def touch_many(self, keys: list[Key]) -> None:
        self._log += keys
        if len(self._log) >= self.LOG_MAX:
            self._play()

    def _play(self) -> None:
        """The logged touches scored in order."""
        keys, self._log = self._log, []
        self._score_keys(keys)

    def _score_keys(self, keys) -> None:
        """Each key's access in turn: a lower layer than the last key's (or a key without one) starts a step; the
        key's score decays to now and gains 1; its new priority waits in `_pending` (compacting when superseded
        entries pile up)."""
        rate, score, prio, pending, seq = self.rate, self._score, self._prio, self._pending, self._seq
        exp, log = math.exp, math.log
        t, last = self._t, self._last_layer
        for key in keys:
            layer = key[0] if isinstance(key, tuple) and key and isinstance(key[0], int) else None
            if layer is None or last is None or layer < last:
                t += 1
            last = layer
            old = score.get(key)
            s = 1.0 if old is None else old[0] * exp(-rate * (t - old[1])) + 1.0
            score[key] = (s, t)
            p = log(s) + rate * t
            prio[key] = p
            pending.append((p, next(seq), key))
            if len(self._heap) + len(pending) > 4 * len(prio) + 64:
                self._t, self._last_layer = t, last
                self._compact()
                score = self._score  # (the compaction may replace it)
        self._t, self._last_layer = t, last

    def remove(self, key: Key) -> None:
        if self._log:
            self._play()
        self._prio.pop(key, None)

    def victims(self) -> Iterator[Key]:
        """Lowest priority first, popping the heap in place: superseded entries (a later access re-scored the
        key, or it was removed) are dropped for good; live ones handed out are pushed back when the caller is
        done unless it evicted them meanwhile. (Copying the heap on every call cost 8% of cold decode.)"""
        if self._log:
            self._play()
        self._flush()
        handed: dict[Key, tuple[float, int, Key]] = {}
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                prio, _, key = item
                if self._prio.get(key) != prio or key in handed:
                    continue
                handed[key] = item
                yield key
        finally:
            for item in handed.values():
                if self._prio.get(item[2]) == item[0]:  # not evicted by the caller, not re-scored
                    heapq.heappush(self._heap, item)

    def _flush(self) -> None:
        """Move the pending entries into the heap (a heap ordered by (priority, sequence) pops the same keys in
        the same order however it was built)."""
        pending = self._pending
        if not pending:
            return
        if len(pending) > len(self._heap) // 8:
            self._heap.extend(pending)
            heapq.heapify(self._heap)
        else:
            for item in pending:
                heapq.heappush(self._heap, item)
        pending.clear()

    def _compact(self) -> None:
        self._pending.clear()
        self._heap = [(p, next(self._seq), k) for k, p in self._prio.items()]
        heapq.heapify(self._heap)
        if len(self._score) > 8 * len(self._prio) + 4096:  # forget history of long-gone keys
            self._score = {k: v for k, v in self._score.items() if k in self._prio}


class HeatPolicy(FrequencyRecencyPolicy):
    """Frequency-weighted recency plus a learned heat: lifetime access counts per expert, persisted across runs.

    The `pinned` hottest experts (by heat from earlier runs, refreshed as this run learns) are evicted only after
    every other entry: a soft pin, so a small budget can never deadlock on pins.
    """

    name = "heat"

    def __init__(self, path: str | Path | None = None, half_life: float = 16.0, carry: float = 0.5) -> None:
        super().__init__(half_life)
        self.path = Path(path) if path is not None else None
        self.carry = carry  # weight of earlier runs' heat when this run's counts are merged in
        self.heat: dict[Key, float] = self._load()
        self.counts: dict[Key, int] = {}
        self.pin_count = 0
        self._hot: frozenset = frozenset()
        self._since_refresh = 0

    def set_pin_count(self, n: int) -> None:
        self.pin_count = max(0, n)
        self._refresh_hot()

    def hot(self) -> frozenset:
        return self._hot

    def _refresh_hot(self) -> None:
        merged = dict(self.heat)
        for k, c in self.counts.items():
            merged[k] = merged.get(k, 0.0) * self.carry + c
        ranked = sorted(merged, key=merged.get, reverse=True)
        self._hot = frozenset(ranked[: self.pin_count])
        self._since_refresh = 0

    def touch_many(self, keys: list[Key]) -> None:
        for key in keys:  # (its counts and refreshes go with each key's bump)
            self._bump(key)

    def _bump(self, key: Key) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
        self._since_refresh += 1
        if self._since_refresh >= 4096:
            self._refresh_hot()
        super()._bump(key)

    def victims(self) -> Iterator[Key]:
        hot, warm = self._hot, []
        for k in super().victims():
            if k in hot:
                warm.append(k)
            else:
                yield k
        yield from warm

    # ---- persistence -----------------------------------------------------------------------------------
    def _load(self) -> dict[Key, float]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            raw = json.loads(self.path.read_text())
            return {(int(a), int(b)): float(v) for a, b, v in raw.get("heat", [])}
        except (OSError, ValueError, TypeError):
            return {}  # a damaged heat file only costs the warm start

    def merged_heat(self) -> dict[Key, float]:
        out = {k: v * self.carry for k, v in self.heat.items()}
        for k, c in self.counts.items():
            out[k] = out.get(k, 0.0) + c
        return out

    def save(self) -> None:
        if self.path is None or not self.counts:
            return
        rows = [[k[0], k[1], round(v, 3)] for k, v in self.merged_heat().items() if isinstance(k, tuple)]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": 1, "heat": rows}))
        os.replace(tmp, self.path)


POLICIES: dict[str, Callable[[], object]] = {"lru": LRUPolicy, "lfru": FrequencyRecencyPolicy, "heat": HeatPolicy}
DEFAULT_POLICY = "lfru"


def heat_path(model_root: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the heat of a checkpoint lives: one JSON file per checkpoint directory under the user cache."""
    import hashlib

    root = Path(model_root).resolve()
    digest = hashlib.sha1(str(root).encode()).hexdigest()[:16]
    base = Path(cache_dir) if cache_dir else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "moestream" / "heat" / f"{root.name}-{digest}.json"
