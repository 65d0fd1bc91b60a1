"""Fused native kernels against torch references: grouped GLU experts (SiLU and SiTU), several weights of one input,
the softmax top-k router, rms_norm, and GQA decode attention (q/k norms, rope, KV rows in place, causal and windowed softmax); odd shapes,
1 and 2 threads; and whole models with them on and off (same logits within 1e-4, same greedy tokens)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import max_rel_diff, prompt_ids, seeded
from moestream import Engine
from moestream.kernels import cpu, fused
from moestream.models import attention, blocks
from moestream.models.rope import Rope
from moestream.synth import synthesize

native = pytest.mark.skipif(not cpu.available(), reason=f"no native kernels here ({cpu.reason()})")


def _experts(n: int, inter: int, k_in: int, d_out: int, seed: int):
    g = seeded(seed)
    return [tuple(torch.randn(*shape, generator=g).bfloat16() for shape in ((inter, k_in), (inter, k_in), (d_out, inter)))
            for _ in range(n)]


def _reference(x, experts, ids, scores, names, act) -> torch.Tensor:
    """float64: out[t] = sum over (t, j) routed to expert names[e] of scores[t, j] * down act(gate x, up x)."""
    out = torch.zeros(x.shape[0], experts[0][2].shape[0], dtype=torch.float64)
    for name, (gate, up, down) in zip(names, experts):
        for t, j in (ids == name).nonzero().tolist():
            xt = x[t].double()
            h = act((gate.double() @ xt), (up.double() @ xt))
            out[t] += scores[t, j].double() * (down.double() @ h)
    return out


def _silu(g, u):
    return F.silu(g) * u


def _situ(g, u, beta=4.0, lb=25.0):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (lb * torch.tanh(u / lb))


@native
@pytest.mark.parametrize("shape", [(33, 17, 40), (64, 32, 64), (100, 7, 9), (130, 48, 96)])
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_moe_glu_matches_float64(shape, act, threads):
    k_in, inter, d_out = shape
    names = [2, 5, 7, 9, 11]  # expert ids; the routing also names experts outside the group (skipped)
    experts = _experts(len(names), inter, k_in, d_out, seed=sum(shape))
    ref_act = _silu if act == "silu" else _situ
    for t in (1, 3, 9, 20, 48, 75):  # 48, 75: 16+ tokens per expert, the panel kernel (one and two vectors)
        x = torch.randn(t, k_in, generator=seeded(t))
        ids = torch.stack([torch.randperm(12, generator=seeded(100 + i))[:4] for i in range(t)])
        scores = torch.rand(t, 4, generator=seeded(t + 7))
        want = _reference(x, experts, ids, scores, names, ref_act)
        got = []
        for n in (1, 2):
            threads(n)
            out = torch.zeros(t, d_out)
            fused.moe_glu_bf16(x, names, [tuple(m.data_ptr() for m in e) for e in experts], inter, out, ids, scores,
                             act, 4.0, 25.0)
            got.append(out)
        assert torch.equal(got[0], got[1])  # each thread owns whole output columns: same sums in the same order
        assert max_rel_diff(got[0], want) < 1e-5


def _routing(t: int, k_in: int, experts: int, k: int, seeds: tuple[int, int, int]):
    """t rows of x [t, k_in], each routed to k distinct of `experts` experts with random scores."""
    x = torch.randn(t, k_in, generator=seeded(t + seeds[0]))
    ids = torch.stack([torch.randperm(experts, generator=seeded(seeds[1] + i))[:k] for i in range(t)])
    return x, ids, torch.rand(t, k, generator=seeded(t + seeds[2]))


@native
def test_moe_glu_one_pass_on_two_threads(threads):
    """Experts big enough to split over two threads (8 x 96 KiB): at 1-3 tokens an expert (the row kernels) both
    passes run as one threaded call, the down projections waiting per expert for its activations; the sums equal
    one thread's bit for bit and the float64 reference's."""
    names = list(range(8))
    experts = _experts(len(names), 64, 128, 128, seed=11)
    for t in (1, 3):
        x, ids, scores = _routing(t, 128, 8, 8, (50, 200, 9))
        got = []
        for n in (1, 2):
            threads(n)
            runs = cpu.pool_stats()["runs"]
            out = torch.zeros(t, 128)
            fused.moe_glu_bf16(x, names, [tuple(m.data_ptr() for m in e) for e in experts], 64, out, ids, scores)
            got.append(out)
            assert cpu.pool_stats()["runs"] - runs == n - 1  # two threads: one threaded call for both passes
        assert torch.equal(got[0], got[1])
        assert max_rel_diff(got[1], _reference(x, experts, ids, scores, names, _silu)) < 1e-5


@native
def test_moe_glu_few_rows_in_long_units(threads):
    """Experts of 1-15 rows a call take pass-1 units of 256 gate/up rows and pass-2 chunks of 512 columns
    (_cpu_step.c GLU_ROWS_FEW / DOWN_CHUNK_FEW): at widths where those split an expert (inter 640: units of 256,
    256 and 128 rows; 1100 outputs: three chunks) the sums equal one thread's bit for bit, the b12-coded twin's bit
    for bit, and the float64 reference's."""
    from moestream.kernels import b12

    names = list(range(8))
    experts = _experts(len(names), 640, 256, 1100, seed=12)
    coded = [[b12.encode(m) for m in e] for e in experts]
    for t in (1, 2, 5, 15):
        x, ids, scores = _routing(t, 256, 8, 4, (70, 300, 11))
        got = []
        for n in (1, 2):
            threads(n)
            for parts in ([tuple(m.data_ptr() for m in e) for e in experts],
                          [tuple(c.data_ptr() | 1 for c in e) for e in coded]):
                out = torch.zeros(t, 1100)
                fused.moe_glu_bf16(x, names, parts, 640, out, ids, scores)
                got.append(out)
        assert all(torch.equal(got[0], g) for g in got[1:]), t
        assert max_rel_diff(got[0], _reference(x, experts, ids, scores, names, _silu)) < 1e-5


@native
def test_moe_glu_without_routing_is_each_expert_alone():
    experts = _experts(1, 25, 40, 56, seed=3)
    for t in (5, 40):  # 40: the panel kernel, two full panels and a half one
        x = torch.randn(t, 40, generator=seeded(4))
        out = torch.zeros(t, 56)
        fused.moe_glu_bf16(x, [0], [tuple(m.data_ptr() for m in experts[0])], 25, out)
        gate, up, down = (m.double() for m in experts[0])
        want = (F.silu(x.double() @ gate.T) * (x.double() @ up.T)) @ down.T
        assert max_rel_diff(out, want) < 1e-5


@native
def test_glu_group_and_expert_fn_take_the_fused_kernel_and_match_torch():
    gate, up, down = _experts(1, 24, 40, 40, seed=5)[0]
    fused = {"gate_up": torch.cat([gate, up]), "down": down}
    named = {"w1": gate, "w3": up, "w2": down}
    x = torch.randn(3, 40, generator=seeded(6))
    fn = blocks.expert_glu()
    with cpu.disabled():
        want = fn(x, {"gate": gate, "up": up, "down": down})
    for t in (fused, named):
        assert blocks.glu_parts(t) is not None
        assert max_rel_diff(fn(x, t), want) < 1e-5
    group = blocks.glu_group()
    ids, w = torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.tensor([[0.7, 0.3], [0.4, 0.6], [1.0, 0.0]])
    out = torch.zeros(3, 40)
    assert group(x, ids, w, [0, 1], [fused, named], out)
    assert max_rel_diff(out, want) < 1e-5  # both experts are the same weights: the weights sum to 1 per row
    assert not group(x, ids, w, [0, 1], [{"gate": gate.float(), "up": up.float(), "down": down.float()}] * 2, out)
    assert not blocks.glu_group(lambda g, u: g * u)(x, ids, w, [0, 1], [fused, named], out)  # unknown activation


@native
def test_linear_many_matches_separate_linears(threads):
    ws = [torch.randn(n, 33, generator=seeded(n)).bfloat16() for n in (5, 64, 17)]
    bs = (None, torch.randn(64, generator=seeded(1)).bfloat16(), None)
    x = torch.randn(3, 33, generator=seeded(2))
    for n in (1, 2):
        threads(n)
        got = blocks.linear_many(x, tuple(ws), bs)
        for y, w, b in zip(got, ws, bs):
            want = x.double() @ w.double().T + (0 if b is None else b.double())
            assert max_rel_diff(y, want) < 1e-5


@native
@pytest.mark.parametrize("tokens,experts,k_in,top", [(1, 64, 1024, 8), (3, 10, 33, 2), (16, 128, 40, 8), (2, 5, 16, 5)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_native_router_matches_softmax_topk(tokens, experts, k_in, top, renormalize):
    x = torch.randn(tokens, k_in, generator=seeded(12))
    gate = torch.randn(experts, k_in, generator=seeded(13)).bfloat16()
    ids, wts = fused.router_softmax_topk(x, gate, top, renormalize)
    with cpu.disabled():
        want_ids, want_wts = blocks.softmax_route(x, gate, top, renormalize)
    assert torch.equal(ids, want_ids)
    assert wts.dtype == torch.float32 and max_rel_diff(wts, want_wts) < 1e-5
    got_ids, got_wts = blocks.softmax_route(x, gate, top, renormalize)  # the dispatching entry takes the kernel
    assert torch.equal(got_ids, ids) and torch.equal(got_wts, wts)


@native
def test_native_router_rejects_bad_operands():
    x, gate = torch.randn(1, 16), torch.randn(8, 16).bfloat16()
    with pytest.raises(ValueError, match="top-9 of 8"):
        fused.router_softmax_topk(x, gate, 9, True)
    with pytest.raises(ValueError, match="bf16 gate"):
        fused.router_softmax_topk(x, gate.float(), 2, True)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, None])
def test_rms_norm_native_matches_torch(dtype):
    x = torch.randn(3, 130, generator=seeded(8)) * 3
    w = None if dtype is None else torch.randn(130, generator=seeded(9)).to(dtype)
    got = blocks.rms_norm(x, w, 1e-6)
    with cpu.disabled():
        want = blocks.rms_norm(x, w, 1e-6)
    assert max_rel_diff(got, want) < 1e-6


def _torch_attention(q, k_new, v_new, k_old, v_old, pos0, qn, kn, rope, window, scale):
    cos, sin = rope.cos_sin(torch.arange(pos0, pos0 + q.shape[0]))
    with cpu.disabled():
        q, k_new = blocks.rms_norm(q, qn, 1e-6), blocks.rms_norm(k_new, kn, 1e-6)
    q, k_new = rope.apply(q, cos, sin), rope.apply(k_new, cos, sin)
    keys, values = torch.cat([k_old, k_new]), torch.cat([v_old, v_new])
    mask = attention.causal_mask(pos0, q.shape[0], keys.shape[0], window)
    return attention.attend(q, keys, values, mask, scale)


@native
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("new", [1, 2, 5])
def test_gqa_attend_matches_torch(window, new):
    hq, hkv, d, pos0 = 6, 2, 16, 7
    g = seeded(new)
    rope = Rope(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), attention_factor=1.1)
    qn, kn = torch.randn(d, generator=g).bfloat16(), torch.randn(d, generator=g).bfloat16()
    k_old, v_old = torch.randn(pos0, hkv, d, generator=g), torch.randn(pos0, hkv, d, generator=g)
    q, k_new, v_new = torch.randn(new, hq, d, generator=g), torch.randn(new, hkv, d, generator=g), \
        torch.randn(new, hkv, d, generator=g)
    want = _torch_attention(q, k_new, v_new, k_old, v_old, pos0, qn, kn, rope, window, d ** -0.5)
    keys, values = torch.cat([k_old, k_new]).contiguous(), torch.cat([v_old, v_new]).contiguous()
    got = fused.gqa_attend(q.clone(), keys, values, new, d ** -0.5, qn, kn, 1e-6, rope.inv_freq,
                         rope.attention_factor, window)
    assert max_rel_diff(got, want) < 1e-5


@native
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_models_same_with_and_without_fused_kernels(family, tmp_path, threads):
    """Prefill (torch paths), then decode steps of one and of three sequences (native attention, grouped experts):
    logits within 1e-4 of the torch paths' and the same greedy tokens, with 1 and 2 threads."""
    synthesize(family, tmp_path / family, "tiny", progress=False)
    ids = prompt_ids(256, 40, seed=3)

    def run():
        eng = Engine.open(tmp_path / family)
        outs, seqs = [], [eng.new_sequence() for _ in range(3)]
        for i, s in enumerate(seqs):
            outs += eng.step([(s, ids[i * 20:i * 20 + 20])])
        tok = [int(torch.argmax(o)) for o in outs]
        for _ in range(4):
            outs += eng.step([(s, [t]) for s, t in zip(seqs, tok)])
            tok = [int(torch.argmax(o)) for o in outs[-3:]]
        return outs

    with cpu.disabled():
        plain = run()
    for n in (1, 2):
        threads(n)
        fused = run()
        assert [int(torch.argmax(a)) for a in fused] == [int(torch.argmax(b)) for b in plain]
        for a, b in zip(fused, plain):
            assert max_rel_diff(a, b) < 1e-4
