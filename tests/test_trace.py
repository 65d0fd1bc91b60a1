"""Routing traces: recording through the engine, skew / reuse statistics, cache replay against the optimum."""
from __future__ import annotations

import argparse

import pytest
import torch

from moestream.errors import MoestreamError
from moestream.experts.policies import LRUPolicy
from moestream.trace import (Trace, add_trace_parser, optimal, read_prompts, record, replay, report, reuse, usage)
from moestream.train.export import export_checkpoint
from moestream.train.model import DemoK3
from moestream.train.recipe import SIZES

TINY = SIZES["tiny"]


def test_lru_replay_by_hand():
    a, b, c = (1, 0), (1, 1), (1, 2)
    steps = [[a], [b], [a], [c], [a], [b]]
    # cap 2: a miss, b miss, a hit, c miss (evicts b), a hit, b miss
    assert replay(steps, 2, LRUPolicy()) == pytest.approx(2 / 6)
    assert optimal(steps, 2) == pytest.approx(2 / 6)
    assert replay(steps, 3, LRUPolicy()) == pytest.approx(3 / 6)


def test_a_step_is_never_evicted_by_itself():
    steps = [[(1, 0), (1, 1), (1, 2)], [(1, 0), (1, 1), (1, 2)]]
    assert replay(steps, 2, LRUPolicy()) == pytest.approx(2 / 6)  # two kept, the third streamed through
    assert optimal(steps, 2) == pytest.approx(2 / 6)


def _random_trace(seed=0, prompts=4, tokens=40, layers=(1, 2, 3), experts=16, k=2) -> Trace:
    g = torch.Generator().manual_seed(seed)
    hot = torch.tensor([4.0] * 3 + [1.0] * (experts - 3))  # skewed, like trained routers
    t = Trace(list(layers), experts, k)
    for _ in range(prompts):
        ids = torch.multinomial(hot.expand(tokens * len(layers), -1), k, generator=g).view(tokens, len(layers), k)
        t.prompts.append(ids)
        t.tokens.append(list(range(tokens)))
    return t


def test_optimal_bounds_every_policy_and_grows_with_size():
    from moestream.experts.policies import POLICIES

    trace = _random_trace()
    steps = trace.accesses()
    last = {"lru": 0.0, "optimal": 0.0}
    for size in (2, 6, 12, 24):
        best = optimal(steps, size)
        for name in POLICIES:
            assert 0.0 <= replay(steps, size, POLICIES[name]()) <= best + 1e-12
        lru = replay(steps, size, LRUPolicy())
        assert lru >= last["lru"] and best >= last["optimal"]  # both are stack algorithms: monotone in size
        last = {"lru": lru, "optimal": best}
    assert optimal(steps, 3 * 16) == pytest.approx(1 - 48 / len([k for s in steps for k in s]), abs=0.05)


def test_usage_and_reuse_statistics():
    t = Trace([1], 4, 2)
    t.prompts.append(torch.tensor([[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]))
    (u,) = usage(t)
    assert u["used"] == 4 and u["max_over_mean"] == pytest.approx(1.0) and u["cv"] == pytest.approx(0.0)
    assert u["effective"] == pytest.approx(4.0)
    assert reuse(t) == [pytest.approx(4 / 6)]  # pairs: same, disjoint, same
    r = report(_random_trace(), [0.5, 1, 2])
    assert [row["experts"] for row in r["caches"]] == [3, 6, 12] and len(r["usage"]) == 3
    assert r["usage"][0]["max_over_mean"] > 1.3  # the skew of the generator shows


def test_read_prompts_formats(tmp_path):
    (tmp_path / "a.txt").write_text("def f():\\n    return 1\nclass A:\n\n")
    assert read_prompts(tmp_path / "a.txt") == ["def f():\n    return 1", "class A:"]
    (tmp_path / "b.txt").write_text("def f():\n    pass\n---\nclass A:\n")
    assert read_prompts(tmp_path / "b.txt") == ["def f():\n    pass\n", "class A:\n"]
    (tmp_path / "c.jsonl").write_text('"x = 1"\n{"prompt": "import os"}\n')
    assert read_prompts(tmp_path / "c.jsonl") == ["x = 1", "import os"]
    (tmp_path / "d.txt").write_text("\n\n")
    with pytest.raises(MoestreamError):
        read_prompts(tmp_path / "d.txt")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from moestream.models.registry import FAMILIES
    from moestream.bpe import default_training_text, train_bpe_tokenizer

    if "kimi_k3" not in FAMILIES:
        pytest.skip("the kimi_k3 inference family is not registered")
    root = tmp_path_factory.mktemp("trace")
    train_bpe_tokenizer(default_training_text(200_000).splitlines(keepends=True), TINY.vocab_size, root / "tok")
    model = DemoK3(TINY, seed=11).eval()
    export_checkpoint(model, root / "tok", root / "ckpt", quantize=False)
    return root / "ckpt"


def test_recorded_routing_is_what_the_model_routes(tiny_checkpoint):
    from moestream import Engine
    from moestream.train.export import load_checkpoint

    eng = Engine.open(tiny_checkpoint)
    prompts = [[5, 9, 100, 3, 7, 8, 200], [1, 2, 3]]
    trace = record(eng, prompts, max_new_tokens=4)
    assert [p.shape for p in trace.prompts] == [(10, 3, 2), (6, 3, 2)]  # prompt + 3 fed-back tokens, MoE 1..3
    model = load_checkpoint(tiny_checkpoint)
    routed: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: routed.append(mod.route(args[0].reshape(
        -1, args[0].shape[-1]))[0])) for m in model.moe_layers()]
    with torch.no_grad():
        model(torch.tensor([trace.tokens[0]]))
    for h in hooks:
        h.remove()
    for j, ids in enumerate(routed):
        assert torch.equal(ids.sort(-1).values, trace.prompts[0][:, j].sort(-1).values)


def test_trace_cli(tiny_checkpoint, tmp_path, capsys):
    from moestream.trace import run_trace

    prompts = tmp_path / "p.txt"
    prompts.write_text("def fibonacci(n):\nclass Stack:\nimport os\nx = [1, 2]\n")
    parser = argparse.ArgumentParser()
    add_trace_parser(parser.add_subparsers())
    args = parser.parse_args(["trace", str(tiny_checkpoint), "--prompts", str(prompts), "--max-new-tokens", "3",
                              "--save", str(tmp_path / "t.jsonl")])
    assert run_trace(args) == 0
    out = capsys.readouterr().out
    assert "P(reuse next)" in out and "cache hit rate" in out and "optimal" in out
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) > 4 and '"experts"' in lines[1]
