"""Byte-budgeted RAM tier for routed experts: residency, eviction policy, pins and statistics.

Owns which experts are resident and how many bytes they hold, against a capacity that the memory accountant
gives it. It does no I/O and never imports torch: values are opaque objects with a byte size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

Key = Hashable


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    layer_hits: dict[int, int] = field(default_factory=dict)
    layer_misses: dict[int, int] = field(default_factory=dict)

    def record(self, layer: int, hit: bool) -> None:
        if hit:
            self.hits += 1
            self.layer_hits[layer] = self.layer_hits.get(layer, 0) + 1
        else:
            self.misses += 1
            self.layer_misses[layer] = self.layer_misses.get(layer, 0) + 1

    def record_hits(self, layer: int, n: int) -> None:
        """`record(layer, True)` n times."""
        self.hits += n
        self.layer_hits[layer] = self.layer_hits.get(layer, 0) + n

    def layer_hit_rates(self) -> dict[int, float]:
        layers = sorted(set(self.layer_hits) | set(self.layer_misses))
        out = {}
        for layer in layers:
            h, m = self.layer_hits.get(layer, 0), self.layer_misses.get(layer, 0)
            out[layer] = h / (h + m) if h + m else 0.0
        return out


def make_policy(name: str) -> Any:
    from moestream.experts.policies import POLICIES

    if name not in POLICIES:
        raise ValueError(f"unknown cache policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name]()


class ExpertCache:
    """Maps key -> (value, nbytes). `capacity()` is asked on every insert, so it can shrink as other state grows.

    `reserve()` books room for a value still being read (its buffer already exists, so it counts as resident);
    `put(..., reserved=True)` turns the booking into the entry. `on_evict(key, value)` lets the owner recycle
    an evicted value's buffer.
    """

    def __init__(self, capacity: Callable[[], int], policy: str | Any = "lru",
                 on_evict: Callable[[Key, Any], None] | None = None):
        self.capacity = capacity
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.on_evict = on_evict
        # called when the budget shrank (state grew) below what booked reads hold: lands or cancels reads that no
        # computation is waiting on, so that their room can be given up (ExpertRunner._squeeze)
        self.on_squeeze: Callable[[], None] | None = None
        # called after the budget shrank (state, scratch or unbooked memory grew): the owner gives back the buffers
        # of the experts evicted for it beyond the cache's free room (ExpertRunner._trim_idle)
        self.on_shrunk: Callable[[], None] | None = None
        self._items: dict[Key, tuple[Any, int]] = {}
        self._pinned: set[Key] = set()
        self.resident_bytes = 0  # entries plus reservations
        self.reserved_bytes = 0
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

    def hits(self, layer: int, experts: list[int]) -> list[Any]:
        """`get((layer, e))` for each of a step's routed experts in turn, each recorded as a hit (the caller found
        them all cached): the policy's touches in one call (`touch_many`)."""
        keys = [(layer, e) for e in experts]
        got = [self._items.get(k) for k in keys]
        self.policy.touch_many([k for k, item in zip(keys, got) if item is not None])
        self.stats.record_hits(layer, len(experts))
        return [None if item is None else item[0] for item in got]

    def touch_hits(self, layer: int, experts: list[int]) -> None:
        """`hits` without the values (a caller that computed from its own table): the touches and the counts."""
        items = self._items
        self.policy.touch_many([(layer, e) for e in experts if (layer, e) in items])
        self.stats.record_hits(layer, len(experts))

    def make_room(self, nbytes: int, keep: frozenset = frozenset(), evict: bool = True) -> bool:
        """Evict until `nbytes` more fit under capacity; False if they cannot (pinned or `keep` entries block, or
        `evict` is False and the free room is short)."""
        cap = self.capacity()
        if self.resident_bytes + nbytes <= cap:
            return True
        if not evict:
            return False
        for key in self.policy.victims():
            if key in self._pinned or key in keep:
                continue
            self._evict(key)
            if self.resident_bytes + nbytes <= cap:
                return True
        return self.resident_bytes + nbytes <= cap

    def reserve(self, nbytes: int, keep: frozenset = frozenset(), evict: bool = True) -> bool:
        """Book `nbytes` (evicting as needed, unless not `evict`) for a value being read; False if it cannot fit."""
        if not self.make_room(nbytes, keep, evict):
            return False
        self.resident_bytes += nbytes
        self.reserved_bytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Return a booking that will not become an entry (the read failed or was dropped)."""
        self.resident_bytes -= nbytes
        self.reserved_bytes -= nbytes

    def put(self, key: Key, value: Any, nbytes: int, keep: frozenset = frozenset(), reserved: bool = False) -> bool:
        """Insert if it fits after eviction; returns False (value not kept) otherwise. `reserved`: room was booked."""
        if reserved:
            self.release(nbytes)
        if key in self._items:
            self.policy.touch(key)
            return True
        if not self.make_room(nbytes, keep):
            return False
        self._items[key] = (value, nbytes)
        self.resident_bytes += nbytes
        self.policy.insert(key)
        return True

    def _evict(self, key: Key) -> None:
        value, nbytes = self._items.pop(key)
        self.resident_bytes -= nbytes
        self.policy.remove(key)
        self.stats.evictions += 1
        if self.on_evict is not None:
            self.on_evict(key, value)

    def free(self) -> int:
        """Bytes that fit without evicting anything."""
        return self.capacity() - self.resident_bytes

    def drop(self, key: Key) -> None:
        """Evict `key` now (if resident and not pinned): a value used once that should not displace others."""
        if key in self._items and key not in self._pinned:
            self._evict(key)

    def pin(self, key: Key) -> None:
        self._pinned.add(key)

    def shrink_to_capacity(self) -> None:
        self.make_room(0)
        if self.resident_bytes > self.capacity() and self.reserved_bytes and self.on_squeeze is not None:
            self.on_squeeze()
            self.make_room(0)
        if self.on_shrunk is not None:
            self.on_shrunk()

    def keys(self) -> list[Key]:
        return list(self._items)
