"""The lfru policy's touches wait in a list until victims are asked for (a warm decode touches experts every layer
and evicts nothing); the victims come out in the same order as from scores computed afresh."""
import math
import random

from moestream.experts.policies import FrequencyRecencyPolicy, HeatPolicy


def _expected_order(p: FrequencyRecencyPolicy) -> list:
    """Live keys by current score (lowest first), from the policy's own score records."""
    now = p._t
    return sorted(p._prio, key=lambda k: p._score[k][0] * math.exp(-p.rate * (now - p._score[k][1])))


def test_touches_do_not_grow_the_heap_until_victims_are_asked_for():
    p = FrequencyRecencyPolicy()
    for e in range(16):
        p.insert((0, e))
    first = list(p.victims())  # builds the heap
    size = len(p._heap)
    for t in range(5):
        for layer in range(4):
            for e in (1, 5, 9):
                p.touch((layer, e)) if (layer, e) in p._prio else p.insert((layer, e))
    assert len(p._heap) == size  # nothing pushed yet
    assert set(first) == {(0, e) for e in range(16)}
    assert list(p.victims()) == _expected_order(p)


def test_victims_follow_scores_through_inserts_touches_removes_and_evictions():
    rng = random.Random(7)
    for cls in (FrequencyRecencyPolicy, HeatPolicy):
        p = cls() if cls is FrequencyRecencyPolicy else cls(path=None)
        for step in range(600):
            layer, e = step % 8, rng.randrange(12)
            key = (layer, e)
            r = rng.random()
            if key not in p._prio:
                p.insert(key)
            elif r < 0.1:
                p.remove(key)
            else:
                p.touch(key)
            if step % 37 == 0:  # an eviction round: take a few victims, evict some of them
                it = p.victims()
                taken = [next(it) for _ in range(min(3, len(p._prio)))]
                it.close()
                for k in taken[:2]:
                    p.remove(k)
            if step % 50 == 0 and cls is FrequencyRecencyPolicy:
                assert list(p.victims()) == _expected_order(p)
        order = list(p.victims())
        assert sorted(order) == sorted(p._prio)
        if cls is FrequencyRecencyPolicy:
            assert order == _expected_order(p)
