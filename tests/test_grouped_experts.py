"""Resident MXFP4 experts computed by one grouped decode give what the per-expert kernel gives, both for
prefill-sized steps (per-expert rows) and for decode-sized batched steps (all rows through all grouped experts);
a warm one-token step through the runner's short path gives what the full step gives."""
from __future__ import annotations

import torch

from moestream import Engine
from moestream.models.latent_moe import LatentMoE
from moestream.synth import synthesize


def _run(path, ids, grouped: bool):
    eng = Engine.open(path)  # no budget: every expert stays resident, so later steps are all hits
    for layer in eng.model.layers:
        if isinstance(layer.ffn, LatentMoE) and not grouped:
            layer.ffn.group = None
    calls = []
    real_run = eng.runner.run

    def spy(*a, **kw):
        calls.append(kw.get("group") is not None)
        return real_run(*a, **kw)

    eng.runner.run = spy
    outs = [eng.logits(ids), eng.logits(ids)]  # cold, then warm (grouped when allowed)
    seqs = [eng.new_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):
        eng.step([(s, ids[i * 8:(i + 1) * 8])])
    for t in range(4):  # decode steps of 3 sequences at once: the all-rows path
        outs += eng.step([(s, [ids[t * 3 + i]]) for i, s in enumerate(seqs)])
    return outs, any(calls)


def test_grouped_mxfp4_experts_match_per_expert(tmp_path):
    synthesize("kimi_k3", tmp_path / "k3", "tiny")
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    grouped, used_group = _run(tmp_path / "k3", ids, grouped=True)
    plain, used_plain = _run(tmp_path / "k3", ids, grouped=False)
    assert used_group and not used_plain
    assert len(grouped) == len(plain) == 14
    for a, b in zip(grouped, plain):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_grouped_native_experts_match_per_expert_and_refuse_scale_255():
    """The grouped path (native when available) against each expert alone, with blob-style views (cached part
    addresses) and plain dicts; a 0xFF scale byte in any grouped expert raises instead of computing."""
    import pytest

    from moestream.errors import CheckpointError
    from moestream.experts.store import PartViews
    from moestream.kernels.quant import quantize_mxfp4
    from moestream.models.latent_moe import make_act, mxfp4_expert, mxfp4_group

    g = torch.Generator().manual_seed(3)
    latent, inter, n_exp = 64, 96, 5

    def expert():
        t = {}
        for name, shape in (("w1", (inter, latent)), ("w3", (inter, latent)), ("w2", (latent, inter))):
            t[f"{name}_packed"], t[f"{name}_scale"] = quantize_mxfp4(torch.randn(*shape, generator=g) * 0.1)
        return t

    experts = [expert() for _ in range(n_exp)]
    act = make_act(4.0, 25.0)
    z = torch.randn(6, latent, generator=g)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g)
    want = torch.zeros(6, latent)
    one = mxfp4_expert(act)
    for e in range(n_exp):
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        want.index_add_(0, rows, one(z[rows], experts[e]) * w[rows, slots].unsqueeze(-1))
    for wrap in (dict, PartViews):
        views = [wrap(t) for t in experts]
        for _ in range(2):  # the second pass uses the addresses cached on PartViews
            out = torch.zeros(6, latent)
            assert mxfp4_group(act)(z, ids, w, list(range(n_exp)), views, out)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    bad = [PartViews({k: v.clone() for k, v in t.items()}) for t in experts]
    bad[3]["w2_scale"][1, 0] = 255
    with pytest.raises(CheckpointError, match="255|0xFF|NaN"):
        mxfp4_group(act)(z, ids, w, list(range(n_exp)), bad, torch.zeros(6, latent))


def test_routing_slices_match_per_expert_nonzero():
    """A multi-row step's pairs sorted once by expert: each expert's slice is exactly the rows (ascending) and the
    routing weights that a compare + nonzero per expert finds, the slots its nonzero gives, and the experts are the
    step's sorted union with their pair counts; the routing as given comes back as the kernels take it."""
    from moestream.experts.dispatch import Routing

    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(37)])  # [37, 4], distinct per row
    weights = torch.rand(37, 4, generator=g).to(torch.bfloat16)
    route = Routing.of(ids, weights)
    assert route.experts == torch.unique(ids).tolist()
    assert route.counts(route.experts) == [int((ids == e).sum()) for e in route.experts]
    for e in reversed(route.experts):  # the per-pair tensors are made on first use, whichever expert asks first
        rows, w = route.pairs(e)
        want_rows, slots = torch.nonzero(ids == e, as_tuple=True)
        assert torch.equal(rows, want_rows)
        assert torch.equal(w, weights[want_rows, slots].unsqueeze(-1).float())
        assert torch.equal(route.slots(e), slots)
    assert torch.equal(route.ids, ids.long()) and route.ids.is_contiguous()
    assert torch.equal(route.raw, weights.float()) and route.raw.dtype == torch.float32


def test_warm_decode_short_path_adds_what_the_full_step_adds(tmp_path, monkeypatch):
    """A warm one-token step (every routed expert cached) takes the runner's short path: the same logits, bit for
    bit, as the full step, cache hits and no misses; the first, cold step does not take it."""
    from conftest import decode_logits, prompt_ids
    from moestream.experts.dispatch import ExpertRunner

    synthesize("qwen3_moe", tmp_path / "q", "tiny")
    eng = Engine.open(tmp_path / "q")  # no budget: everything read stays cached
    eng.runner.lookahead.reads = 0  # no read ahead: whether one is still in flight would depend on thread timing
    ids = prompt_ids(eng.vocab_size, 12)
    taken = []
    real = ExpertRunner._resident_step

    def spy(self, *a):
        taken.append(real(self, *a))
        return taken[-1]

    monkeypatch.setattr(ExpertRunner, "_resident_step", spy)
    cold = decode_logits(eng, ids)
    assert not taken[0]  # the first step reads experts
    taken.clear()
    stats = eng.runner.cache.stats
    hits, misses = stats.hits, stats.misses
    warm = decode_logits(eng, ids)  # the same tokens again: every expert is cached now
    assert taken and all(taken)  # nothing read ahead, nothing in flight: every warm step takes the short path
    assert stats.misses == misses and stats.hits > hits
    monkeypatch.setattr(ExpertRunner, "_resident_step", lambda *a: False)
    full = decode_logits(eng, ids)
    assert torch.equal(warm, full)
    assert float((warm - cold).abs().max() / cold.abs().max()) < 1e-6


def test_one_token_situ_group_is_the_two_call_frame_bit_for_bit(monkeypatch):
    """A decode step's one row through its routed MXFP4 SiTU experts in one native call (latent_moe._one_token_situ)
    gives the bits of the two-call frame (routed_group + `native`): routed experts in any order of `experts`, some
    routed experts outside the group (the runner's misses), an out that already holds a sum, an input with a
    non-finite-free but wide range; and a 0xFF scale byte in any of w1, w3, w2 of any expert raises, out untouched."""
    import pytest

    from moestream.errors import CheckpointError
    from moestream.experts.store import PartViews
    from moestream.kernels import cpu
    from moestream.kernels.quant import quantize_mxfp4
    from moestream.models import latent_moe

    if not cpu.available():
        pytest.skip("no native kernels")
    g = torch.Generator().manual_seed(11)
    latent, inter, n_exp, k = 96, 160, 9, 6

    def expert():
        t = {}
        for name, shape in (("w1", (inter, latent)), ("w3", (inter, latent)), ("w2", (latent, inter))):
            t[f"{name}_packed"], t[f"{name}_scale"] = quantize_mxfp4(torch.randn(*shape, generator=g) * 0.1)
        return PartViews(t)

    experts = [expert() for _ in range(n_exp)]
    act = latent_moe.make_act(4.0, 25.0)
    calls = []
    real = latent_moe._one_token_situ
    monkeypatch.setattr(latent_moe, "_one_token_situ", lambda *a: calls.append(1) or real(*a))

    def run(one: bool, z, ids, w, group, tensors, start):
        if not one:
            monkeypatch.setattr(latent_moe, "_one_token_situ", lambda *a: False)
        out = start.clone()
        assert latent_moe.mxfp4_group(act)(z, ids, w, group, tensors, out)
        monkeypatch.setattr(latent_moe, "_one_token_situ", lambda *a: calls.append(1) or real(*a))
        return out

    for trial in range(6):
        z = torch.randn(1, latent, generator=g) * (10.0 ** (trial - 2))
        ids = torch.randperm(n_exp, generator=g)[:k].view(1, k)
        w = torch.rand(1, k, generator=g)
        group = ids[0, : k - trial % 3].tolist()  # the rest missed: computed elsewhere
        group = [group[i] for i in torch.randperm(len(group), generator=g).tolist()]
        tensors = [experts[e] for e in group]
        start = torch.randn(1, latent, generator=g)
        n = len(calls)
        fused = run(True, z, ids, w, group, tensors, start)
        assert len(calls) == n + 1
        assert torch.equal(fused, run(False, z, ids, w, group, tensors, start))
        assert not torch.equal(fused, start)
    ids = torch.arange(4).view(1, 4)
    w = torch.rand(1, 4, generator=g)
    z = torch.randn(1, latent, generator=g)
    for j in range(4):
        for part in ("w1_scale", "w3_scale", "w2_scale"):
            bad = [PartViews({name: v.clone() for name, v in experts[e].items()}) for e in range(4)]
            bad[j][part][2, 1] = 255
            out = torch.zeros(1, latent)
            with pytest.raises(CheckpointError, match="255|0xFF|NaN"):
                latent_moe.mxfp4_group(act)(z, ids, w, [0, 1, 2, 3], bad, out)
            assert torch.equal(out, torch.zeros(1, latent))
