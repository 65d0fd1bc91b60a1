"""Cache policies: LRU order, frequency-weighted recency keeps frequently used experts through a scan, heat persists
across runs and protects its hottest experts, the cache honours reservations and pins, and every policy runs the
engine to the same result under a tight budget."""
from __future__ import annotations

import random

import pytest

from moestream.experts.cache import ExpertCache
from moestream.experts.policies import POLICIES, FrequencyRecencyPolicy, HeatPolicy, LRUPolicy, heat_path


def _cache(policy, capacity: int, evicted: list | None = None) -> ExpertCache:
    return ExpertCache(lambda: capacity, policy, on_evict=(lambda k, v: evicted.append(k)) if evicted is not None
                       else None)


def test_lru_evicts_least_recent():
    c = _cache(LRUPolicy(), 3)
    for k in "abc":
        c.put(k, k, 1)
    c.get("a")
    c.put("d", "d", 1)
    assert set(c.keys()) == {"a", "c", "d"}


def test_lfru_keeps_frequent_entries_through_a_scan():
    """A one-off scan of new keys must not flush keys used many times (LRU would flush them)."""
    for policy, survives in ((FrequencyRecencyPolicy(half_life=64), True), (LRUPolicy(), False)):
        c = _cache(policy, 4)
        for _ in range(10):
            for k in ("hot1", "hot2"):
                c.put(k, k, 1) if k not in c else c.get(k)
        for i in range(6):  # scan: six keys seen once
            c.put(f"scan{i}", i, 1)
        assert ("hot1" in c and "hot2" in c) == survives, policy.name


def test_lfru_recency_wins_over_stale_frequency():
    pol = FrequencyRecencyPolicy(half_life=4)
    c = _cache(pol, 2)
    c.put("old", 0, 1)
    for _ in range(5):
        c.get("old")
    for i in range(40):  # long after, "new" is used a few times; "old"'s count has decayed
        c.put("new", 1, 1) if "new" not in c else c.get("new")
    c.put("x", 2, 1)
    assert "new" in c and "old" not in c


def test_victims_skip_superseded_heap_entries():
    pol = FrequencyRecencyPolicy(half_life=8)
    for k in range(50):
        pol.insert(k)
    for _ in range(300):
        pol.touch(7)
    order = list(pol.victims())
    assert sorted(order) == list(range(50)) and order[-1] == 7  # each key once, the hot one last
    pol.remove(7)
    assert 7 not in list(pol.victims())


def test_victims_in_place_survive_partial_iteration_and_skipped_keys():
    """victims() pops the heap in place: after partly consumed iterations whose caller evicts some keys and skips
    others, the full order is still every live key once, lowest score first (the scores a fresh policy gives)."""
    import random

    rng = random.Random(0)
    pol = FrequencyRecencyPolicy(half_life=4)
    live: set[int] = set()
    for step in range(400):
        k = rng.randrange(40)
        if k in live and rng.random() < 0.1:
            pol.remove(k)
            live.discard(k)
        else:
            (pol.touch if k in live else pol.insert)(k)
            live.add(k)
        if step % 7 == 0:
            for i, v in enumerate(pol.victims()):  # evict every other candidate, stop after a few
                if i % 2 == 0:
                    pol.remove(v)
                    live.discard(v)
                if i >= 4:
                    break
    order = list(pol.victims())
    assert sorted(order) == sorted(live)
    prio = [pol._prio[k] for k in order]
    assert prio == sorted(prio)


def test_heat_persists_and_protects_hottest(tmp_path):
    path = tmp_path / "heat.json"
    first = HeatPolicy(path)
    for _ in range(20):
        first.touch((3, 5))
    first.touch((3, 6))
    first.save()
    second = HeatPolicy(path)
    assert second.heat[(3, 5)] > second.heat[(3, 6)] > 0
    second.set_pin_count(1)
    assert second.hot() == frozenset({(3, 5)})
    c = _cache(second, 3)
    c.put((3, 5), "hot", 1)
    for e in range(10):  # many newer, more recent entries: the hot expert is evicted last
        c.put((0, e), e, 1)
    assert (3, 5) in c


def test_heat_file_damage_is_ignored(tmp_path):
    path = tmp_path / "heat.json"
    path.write_text("{not json")
    assert HeatPolicy(path).heat == {}


def test_heat_path_is_per_checkpoint(tmp_path):
    a, b = heat_path(tmp_path / "m1", tmp_path), heat_path(tmp_path / "m2", tmp_path)
    assert a != b and a.parent == b.parent and a.suffix == ".json"


def test_reservations_count_and_convert():
    evicted = []
    c = _cache(LRUPolicy(), 10, evicted)
    c.put("a", 1, 4)
    c.put("b", 2, 4)
    assert c.reserve(6, keep=frozenset({"b"}))  # evicts a, not b
    assert evicted == ["a"] and c.resident_bytes == 10 and c.reserved_bytes == 6
    assert not c.reserve(1, keep=frozenset({"b"}))  # b kept, 6 reserved: no room
    assert c.put("c", 3, 6, reserved=True) and c.reserved_bytes == 0 and c.resident_bytes == 10


def test_pinned_entries_are_never_evicted():
    c = _cache(LRUPolicy(), 2)
    c.put("p", 0, 1)
    c.pin("p")
    for k in "xyz":
        c.put(k, k, 1)
    assert "p" in c


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM

    from conftest import save_reference
    from test_reader import _qwen_config

    path = tmp_path_factory.mktemp("qwen_policies")
    save_reference(Qwen3MoeForCausalLM, _qwen_config(), path)
    return path


def test_policies_agree_under_a_tight_budget(ckpt, tmp_path, monkeypatch):
    from moestream.engine.engine import plan
    from test_reader import _greedy

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    p = plan(ckpt)
    budget = p.dense_bytes + p.scratch_bytes + p.expert_bytes // 4 + 400_000
    outs = {}
    for name in sorted(POLICIES):
        _, out, stats, _ = _greedy(ckpt, budget, n=6, cache_policy=name)
        assert stats["peak_resident_bytes"] <= budget and stats["expert_evictions"] > 0
        outs[name] = out
    assert len({tuple(o) for o in outs.values()}) == 1


@pytest.mark.parametrize("name", ["lru", "lfru", "heat"])
def test_touch_many_equals_touches_one_by_one(name):
    """A step's touches in one call (ExpertCache.hits -> policy.touch_many) leave the policy as touching the same
    keys one by one does: the same victims in the same order, through heap compactions and the heat's refreshes."""
    rng = random.Random(4)
    one, many = POLICIES[name](), POLICIES[name]()
    if name == "heat":
        one.set_pin_count(5)
        many.set_pin_count(5)
    for p in (one, many):
        for layer in range(4):
            for e in range(16):
                p.insert((layer, e))
    for _ in range(700):  # steps of 4 layers x top-3 (a few thousand touches: compactions, a heat refresh)
        for layer in range(4):
            keys = [(layer, e) for e in sorted(rng.sample(range(16), 3))]
            for k in keys:
                one.touch(k)
            many.touch_many(keys)
        if rng.random() < 0.1:  # one call across layers (a lower layer starts a step inside the call)
            keys = [(3, rng.randrange(16)), (0, rng.randrange(16)), (1, rng.randrange(16))]
            for k in keys:
                one.touch(k)
            many.touch_many(keys)
        if rng.random() < 0.05:
            gone = (rng.randrange(4), rng.randrange(16))
            one.remove(gone)
            many.remove(gone)
            one.insert(gone)
            many.insert(gone)
    assert list(one.victims()) == list(many.victims())
    if name != "lru":
        assert one._score == many._score and one._t == many._t and one._prio == many._prio
