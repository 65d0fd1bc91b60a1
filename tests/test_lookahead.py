"""Router lookahead for every family's router: the predictor registered for a MoE layer is that layer's exact
selection rule (softmax top-k, group-limited sigmoid with correction bias, K3's full-width latent-MoE router,
gpt-oss's biased router) and ranks wider by the same scores when asked, reading ahead never changes what is computed, and the gate closes on low recall."""
from __future__ import annotations

import pytest
import torch

from conftest import expert_budget, prompt_ids, synth_tiny
from moestream import Engine
from moestream.experts.prefetch import Lookahead
from moestream.models.blocks import SoftmaxRouter

SYNTH = ("qwen3_moe", "mixtral", "kimi_linear", "kimi_k3")
FAMILIES = SYNTH + ("deepseek_v3", "gpt_oss")


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    """A tiny random checkpoint of each family: moestream.synth's, or (DeepSeek-V3, gpt-oss) the parity tests'
    transformers models, whose router weights and biases are large enough that groups and biases matter."""
    family = request.param
    if family in SYNTH:
        return synth_tiny(tmp_path_factory, family)
    path = tmp_path_factory.mktemp(family)
    if family == "deepseek_v3":
        from test_deepseek_v3 import tiny_model
    else:
        from test_gpt_oss import tiny_model
    tiny_model().save_pretrained(path)
    return path


def _open(path, **lookahead) -> Engine:
    eng = Engine.open(path, ram_budget=expert_budget(path))  # about 30% of the experts fit: evictions
    for name, value in lookahead.items():
        setattr(eng.runner.lookahead, name, value)
    return eng


def _greedy(eng: Engine, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    state = eng.new_sequence()
    logits = eng.prefill(state, prompt)
    out, rows = [], []
    for _ in range(n):
        out.append(int(logits.argmax()))
        rows.append(logits)
        (logits,) = eng.step([(state, [out[-1]])])
    eng.free(state)
    return out, torch.stack(rows)


def test_predictor_is_the_next_routers_own_selection(ckpt):
    """Every MoE layer registers a predictor, and fed the input that layer's router really read (prefill chunks
    and decode rows), it returns exactly the ids that router selected."""
    eng = _open(ckpt)
    seen = []  # (layer, the router's input, the ids it routed to)
    run = eng.runner.run

    def spy(layer, x, ids, weights, fn, *args, router_input=None, **kwargs):
        seen.append((layer, (x if router_input is None else router_input).clone(), ids.clone()))
        return run(layer, x, ids, weights, fn, *args, router_input=router_input, **kwargs)

    eng.runner.run = spy
    _greedy(eng, prompt_ids(eng.vocab_size, 9), 4)
    routers, moe = eng.runner.lookahead.routers, eng.plan.layout.moe_layers
    assert sorted(routers) == sorted(moe) and len(moe) > 1
    assert {layer for layer, _, _ in seen} == set(moe)
    experts = eng.runner.store.num_experts
    for layer, x, ids in seen:
        assert torch.equal(routers[layer](x), ids), f"layer {layer}: the lookahead would predict other experts"
        # twice as wide (the remote fetch-ahead's guess): distinct experts, the router's own choice among them
        wide = routers[layer](x, 2)
        assert wide.shape[0] == ids.shape[0] and ids.shape[1] < wide.shape[1] <= min(2 * ids.shape[1], experts)
        for row, chosen in zip(wide.tolist(), ids.tolist()):
            assert len(set(row)) == len(row) and set(chosen) <= set(row) and max(row) < experts
    # every MoE layer after the first was predicted from the layer before it (and scored)
    assert sorted(eng.runner.lookahead.gates) == sorted(moe)[1:]
    eng.close()


def test_lookahead_never_changes_outputs(ckpt):
    """Greedy tokens with the gate forced open and several reads ahead per step equal those without lookahead,
    under a budget that forces evictions; the reads really happened."""
    prompt = prompt_ids(Engine.open(ckpt).vocab_size, 12)
    off = _open(ckpt, enabled=False)
    tokens_off, logits_off = _greedy(off, prompt, 16)
    assert off.runner.times.prefetch_reads == 0
    off.close()
    on = _open(ckpt, threshold=0.0, warmup=0, reads=4)
    tokens_on, logits_on = _greedy(on, prompt, 16)
    assert on.runner.times.prefetch_reads > 0
    on.close()
    assert tokens_on == tokens_off
    assert torch.allclose(logits_on, logits_off, rtol=1e-4, atol=1e-4)


def test_gate_turns_off_a_layer_whose_recall_is_low():
    """Real routers on both layers: layer 1's input is the proxy the lookahead saw (recall 1), layer 2's input is
    unrelated to it (recall near chance, k/E). Layer 1's prefetch is issued, layer 2's never is, though layer 2
    keeps being predicted and scored on one step in `probe`."""
    gen = torch.Generator().manual_seed(0)
    hidden, experts, k = 32, 16, 2
    routers = {layer: SoftmaxRouter(torch.randn(experts, hidden, generator=gen), k, False) for layer in (0, 1, 2)}
    la = Lookahead(threshold=0.5, warmup=4)
    for layer, r in routers.items():
        la.register(layer, r.select)
    issued = {1: 0, 2: 0}
    for _ in range(24):
        x = torch.randn(1, hidden, generator=gen)
        issued[1] += la.predict(0, x, experts) is not None
        la.observe(1, routers[1].select(x)[0].tolist())
        issued[2] += la.predict(1, x, experts) is not None
        la.observe(2, routers[2].select(torch.randn(1, hidden, generator=gen))[0].tolist())
    report = la.report()
    assert report[1]["on"] and report[1]["lifetime_recall"] == 1.0 and issued[1] == 24 - la.warmup
    assert not report[2]["on"] and report[2]["lifetime_recall"] < 0.4 and issued[2] == 0
    # still measured while off (one step in `probe`), so it can switch on again
    closed = la.gates[2].closed_steps
    assert closed > 0 and la.gates[2].scored == 24 - closed + closed // la.probe


def test_fetch_ahead_wraps_to_the_next_tokens_first_layers_and_scores_them():
    """Past the last MoE layer the fetch-ahead's chain goes on to the next token's first MoE layer: its router on
    this token's input, wrap_width x k wide, best first; nothing of it reaches the RAM read-ahead (predict returns
    None at the last layer). When that layer routes, the guess is scored in wrap_gates (recall = routed experts it
    named / routed), apart from the one-layer-ahead gates. wrap_width 0 turns it off."""
    gen = torch.Generator().manual_seed(0)
    hidden, experts, k = 32, 16, 2
    routers = {layer: SoftmaxRouter(torch.randn(experts, hidden, generator=gen), k, False) for layer in (0, 1, 2)}
    handed = []
    la = Lookahead(warmup=0, threshold=0.0, fill_depth=2, wrap_width=2, fill=handed.append)
    for layer, r in routers.items():
        la.register(layer, r.select)
    x = torch.randn(1, hidden, generator=gen)
    wide0 = routers[0].select(x, 2)[0].tolist()
    assert la.predict(1, x, experts) is not None  # layer 2 read ahead into RAM as before ...
    assert handed[-1] == [(2, routers[2].select(x)[0].tolist()), (0, wide0)]  # ... and layer 0 of the next token
    assert la.predict(2, x, experts) is None  # the last layer: nothing to read into RAM ahead ...
    assert handed[-1] == [(0, wide0)]  # ... but the next token's first layer is fetched ahead
    routed = [wide0[0], next(e for e in range(experts) if e not in wide0)]
    la.observe(0, routed)
    g = la.wrap_gates[0]
    assert (g.scored, g.predicted, g.correct, g.routed) == (1, 2 * k, 1, 2)
    assert la.wrap_report() == {0: {"lifetime_recall": 0.5, "scored": 1, "predicted_per_step": 4.0}}
    assert 0 not in la.gates  # layer 0 has no one-layer-ahead prediction to score
    la.observe(0, routed)  # a step with no guess pending scores nothing
    assert la.wrap_gates[0].scored == 1
    handed.clear()
    la.wrap_width = 0
    la.predict(2, x, experts)
    la.predict(1, x, experts)
    assert handed == [[(2, routers[2].select(x)[0].tolist())]]
