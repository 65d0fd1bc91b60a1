"""`moestream plan`'s batch reads replayed from a recorded routing (several prompts decoding together through the
engine's cache policy). Nothing is timed: rates are seeded."""
from __future__ import annotations

import pytest

from conftest import synth_tiny
from moestream.planner.skew import Skew, batch_windows, distinct, from_report, replay_batch, routing_report
from test_plan import RATES, _facts_scenario, seeded_cache  # noqa: F401 - the autouse cache fixture


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth_tiny(tmp_path_factory, "qwen3_moe")


def _own_experts(prompts: int, tokens: int, k: int, layers: int = 1) -> list:
    """Each prompt routes every token to its own k experts (prompt p: experts p*k .. p*k + k - 1)."""
    return [[[[p * k + i for i in range(k)] for _ in range(layers)] for _ in range(tokens)] for p in range(prompts)]


def test_batch_windows_take_distinct_prompts_first():
    routing = [[[[p, t]] for t in range(8)] for p in range(3)]  # prompt p, token t
    wins = batch_windows(routing, 2, 2)  # two windows of 4 tokens a prompt
    assert [w[0][0] for w in wins] == [[0, 0], [1, 0], [2, 0], [0, 4], [1, 4], [2, 4]]
    assert batch_windows(routing, 6, 4) == []


def test_replay_batch_keeps_each_sequences_own_experts():
    """Four sequences, each reusing its own 4 experts every token, in a cache of 16: after their prompts nothing is
    read, where the pooled popularity (16 equally popular experts, 4 cached per sequence's share) reads most of
    them every step; fewer recorded prompts than sequences: no replay."""
    routing = _own_experts(4, 12, 4)
    reads, used, hit, what = replay_batch(routing, 16, 8, 4, 4, 64)
    assert reads == 0 and used == 16 and hit == 1.0 and "4 windows" in what
    tight, _, _, _ = replay_batch(routing, 8, 8, 4, 4, 64)  # room for half: the 8 held stay, the rest stream
    assert tight == 8
    assert replay_batch(routing, 16, 8, 4, 5, 64) is None
    skew = from_report(routing_report(routing, 64, 4), "test")
    _, missing = distinct(64, 4, skew.layers[0], 4, 4, skew.reuse)
    assert missing > 1


def test_replay_batch_scan_evicts_nothing():
    """A step routing to at least half of a layer's experts reads what it lacks without evicting (the engine's scan),
    so the experts its prompts left stay and it reads its own every step; below that share it evicts them."""
    # prompt p's tokens route to experts 4p..4p+3, its generated tokens to 8+4p..8+4p+3
    routing = [[[[(0 if t < 4 else 8) + 4 * p + i for i in range(4)]] for t in range(6)] for p in range(2)]
    scan, _, _, _ = replay_batch(routing, 8, 4, 2, 2, 16)  # 8 of 16 experts a step: a scan
    evict, _, _, _ = replay_batch(routing, 8, 4, 2, 2, 64)  # 8 of 64: the first step evicts, the second hits
    assert scan == 8 and evict == 4


def test_batch_decode_takes_the_replayed_reads(tiny):
    """With a recorded routing of at least as many prompts as the batch's sequences, a cold batch's reads per step
    are the replay's (the analytic pooled popularity otherwise); the plan states it."""
    from moestream.planner.predict import Scenario

    sc = _facts_scenario(tiny, 0.5, {**RATES, "disk": 1e8})
    f = sc.facts
    k = f.top_k
    routing = _own_experts(2, 12, k, f.moe_layers)
    skew = from_report(routing_report(routing, f.num_experts, k), "test")
    rep = Scenario(f, sc.fit, sc.rates, skew)
    cap = int(rep.cached_per_layer(2 * 1000.0) * f.moe_layers)
    got = rep.decode(2, 10, 2 * 1000.0, since_open=(8, 4))
    want = replay_batch(routing, cap, 8, 4, 2, f.num_experts)
    assert got.expert_reads == pytest.approx(want[0]) and rep.replayed_batch == want[3]
    analytic = Scenario(f, sc.fit, sc.rates, skew).decode(3, 10, 3 * 1000.0, since_open=(8, 4))  # 3 > 2 prompts
    assert analytic.expert_reads > 0
