"""Byte-budgeted RAM tier for routed experts: residency, eviction policy, pins and statistics.

Owns which experts are resident and how many bytes they hold, against a capacity that the memory accountant
gives it. It does no I/O and never imports torch: values are opaque objects with a byte size.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

Key = Hashable


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_inserted: int = 0
    layer_hits: dict[int, int] = field(default_factory=dict)
    layer_misses: dict[int, int] = field(default_factory=dict)

    def record(self, layer: int, hit: bool) -> None:
        if hit:
            self.hits += 1
            self.layer_hits[layer] = self.layer_hits.get(layer, 0) + 1
        else:
            self.misses += 1
            self.layer_misses[layer] = self.layer_misses.get(layer, 0) + 1

    def layer_hit_rates(self) -> dict[int, float]:
        layers = sorted(set(self.layer_hits) | set(self.layer_misses))
        out = {}
        for layer in layers:
            h, m = self.layer_hits.get(layer, 0), self.layer_misses.get(layer, 0)
            out[layer] = h / (h + m) if h + m else 0.0
        return out


class LRUPolicy:
    """Least recently used: evict the entry touched longest ago."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victims(self):
        return iter(list(self._order))


POLICIES: dict[str, Callable[[], Any]] = {"lru": LRUPolicy}


class ExpertCache:
    """Maps key -> (value, nbytes). `capacity()` is asked on every insert, so it can shrink as other state grows."""

    def __init__(self, capacity: Callable[[], int], policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.capacity = capacity
        self.policy = POLICIES[policy]()
        self._items: dict[Key, tuple[Any, int]] = {}
        self._pinned: set[Key] = set()
        self.resident_bytes = 0
        self.stats = CacheStats()

    def __contains__(self, key: Key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Key) -> Any | None:
        item = self._items.get(key)
        if item is None:
            return None
        self.policy.touch(key)
        return item[0]

    def make_room(self, nbytes: int, keep: frozenset = frozenset()) -> bool:
        """Evict until `nbytes` more fit under capacity; False if they cannot (pinned or `keep` entries block)."""
        cap = self.capacity()
        if self.resident_bytes + nbytes <= cap:
            return True
        for key in self.policy.victims():
            if key in self._pinned or key in keep:
                continue
            self._evict(key)
            if self.resident_bytes + nbytes <= cap:
                return True
        return self.resident_bytes + nbytes <= cap

    def put(self, key: Key, value: Any, nbytes: int, keep: frozenset = frozenset()) -> bool:
        """Insert if it fits after eviction; returns False (value not kept) otherwise."""
        if key in self._items:
            self.policy.touch(key)
            return True
        if not self.make_room(nbytes, keep):
            return False
        self._items[key] = (value, nbytes)
        self.resident_bytes += nbytes
        self.stats.bytes_inserted += nbytes
        self.policy.touch(key)
        return True

    def _evict(self, key: Key) -> None:
        _, nbytes = self._items.pop(key)
        self.resident_bytes -= nbytes
        self.policy.remove(key)
        self.stats.evictions += 1

    def pin(self, key: Key) -> None:
        self._pinned.add(key)

    def unpin(self, key: Key) -> None:
        self._pinned.discard(key)

    def shrink_to_capacity(self) -> None:
        self.make_room(0)

    def keys(self) -> list[Key]:
        return list(self._items)
