"""KDA: chunked prefill vs token recurrence, state carried across calls, and the mixer vs transformers' torch path."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import FakeWeights
from moestream.memory.accountant import MemoryAccountant
from moestream.memory.state import Batch, SeqState
from moestream.models.kda import KDAMixer, KDAOptions, kda_chunked, kda_recurrent, l2norm


def rel_rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def random_inputs(n: int, heads: int = 3, d: int = 16, decay: str = "mixed", seed: int = 0):
    g_ = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, heads, d, generator=g_), 1e-6) * d ** -0.5
    k = l2norm(torch.randn(n, heads, d, generator=g_), 1e-6)
    v = torch.randn(n, heads, d, generator=g_)
    beta = torch.rand(n, heads, generator=g_)
    u = torch.rand(n, heads, d, generator=g_)
    if decay == "strong":  # every channel near K3's lower bound of -5 per step
        g = -5.0 * (0.9 + 0.1 * u)
    elif decay == "unbounded":  # Kimi Linear's softplus decay can go far below -5
        g = -60.0 * u
    else:  # mostly mild with some strongly decaying channels
        g = torch.where(u > 0.8, -5.0 * u, -0.05 * u)
    return q, k, v, g, beta


@pytest.mark.parametrize("n", [1, 37, 64, 130, 200])
@pytest.mark.parametrize("decay", ["mixed", "strong", "unbounded"])
def test_chunked_matches_recurrence(n, decay):
    q, k, v, g, beta = random_inputs(n, decay=decay, seed=n)
    S0 = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(7)) * 0.3
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, S0)
    o, s = kda_chunked(q, k, v, g, beta, S0, chunk=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_rmse(o, o_ref) < 1e-5
    assert rel_rmse(s, s_ref) < 1e-5


def test_chunked_in_pieces_equals_one_call():
    q, k, v, g, beta = random_inputs(150)
    S0 = torch.zeros(3, 16, 16)
    o_all, s_all = kda_chunked(q, k, v, g, beta, S0)
    S, outs = S0, []
    for a, b in [(0, 70), (70, 71), (71, 150)]:
        o, S = kda_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], S)
        outs.append(o)
    assert rel_rmse(torch.cat(outs), o_all) < 1e-5 and rel_rmse(S, s_all) < 1e-5


def test_matches_transformers_kernels_fallback():
    """Our chunked / recurrent forms against transformers' torch fallbacks of chunk_kda / fused_recurrent_kda."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta = random_inputs(100, decay="mixed")
    raw_q, raw_k = torch.randn(100, 3, 16), torch.randn(100, 3, 16)
    ref, ref_s = hf.chunk_kimi_delta_attention(raw_q[None], raw_k[None], v[None], g[None], beta[None],
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = l2norm(raw_q, 1e-6) * 16 ** -0.5, l2norm(raw_k, 1e-6)
    o, s = kda_chunked(qn, kn, v, g, beta, torch.zeros(3, 16, 16))
    assert rel_rmse(o, ref[0]) < 1e-5 and rel_rmse(s, ref_s[0]) < 1e-5
    ref1, _ = hf.recurrent_kimi_delta_attention(raw_q[None, :1], raw_k[None, :1], v[None, :1], g[None, :1],
                                                beta[None, :1], ref_s[0][None] * 0, True, True)
    o1, _ = kda_recurrent(qn[:1], kn[:1], v[:1], g[:1], beta[:1], torch.zeros(3, 16, 16))
    assert rel_rmse(o1, ref1[0]) < 1e-5


def kda_weights(hidden: int, opt: KDAOptions, seed: int = 0, a_log_pad: int = 0) -> dict[str, torch.Tensor]:
    g_ = torch.Generator().manual_seed(seed)
    c, d, h = opt.heads * opt.head_dim, opt.head_dim, opt.heads

    def r(*shape, std=0.2):
        return torch.randn(*shape, generator=g_) * std

    t = {f"{n}_proj.weight": r(c, hidden) for n in "qkv"}
    t.update({f"{n}_conv1d.weight": r(c, 1, opt.conv_kernel, std=0.5) for n in "qkv"})
    t.update({"f_a_proj.weight": r(d, hidden), "f_b_proj.weight": r(c, d), "b_proj.weight": r(h, hidden),
              "A_log": torch.cat([torch.rand(h, generator=g_) * 2.5, torch.zeros(a_log_pad)]),
              "dt_bias": r(c), "o_norm.weight": 1 + r(d), "o_proj.weight": r(hidden, c)})
    if opt.output_gate == "low_rank":
        t.update({"g_a_proj.weight": r(d, hidden), "g_b_proj.weight": r(c, d)})
    else:
        t["g_proj.weight"] = r(c, hidden)
    return {"attn." + k: v for k, v in t.items()}


def run_mixer(mixer: KDAMixer, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
    mem = MemoryAccountant(None)
    state, outs = SeqState(mem, 1), []
    for n in splits:
        outs.append(mixer(x[state.pos:state.pos + n], Batch.build([(state, n)]), 0))
        state.pos += n
    assert state.fixed_bytes == mem.state_bytes > 0  # accounted once, on creation
    return torch.cat(outs)


@pytest.mark.parametrize("variant", ["kimi_linear", "k3"])
def test_state_carried_across_calls_equals_one_call(variant):
    if variant == "k3":
        opt = KDAOptions(heads=3, head_dim=16, decay="lower_bound_sigmoid", output_gate="full_rank")
    else:
        opt = KDAOptions(heads=3, head_dim=16)
    mixer = KDAMixer(FakeWeights(kda_weights(32, opt, a_log_pad=5 if variant == "k3" else 0)), "attn", opt)
    x = torch.randn(90, 32, generator=torch.Generator().manual_seed(3))
    one = run_mixer(mixer, x, [90])
    for splits in ([1] * 90, [2, 1, 1, 70, 3, 13], [65, 25]):
        assert rel_rmse(run_mixer(mixer, x, splits), one) < 1e-5


def test_lower_bound_decay_uses_first_heads_of_a_log():
    opt = KDAOptions(heads=3, head_dim=16, decay="lower_bound_sigmoid", gate_lower_bound=-5.0)
    t = kda_weights(32, opt, a_log_pad=5)
    mixer = KDAMixer(FakeWeights(t), "attn", opt)
    x = torch.randn(10, 32) * 5
    g = mixer.decay(x)
    f = (x @ t["attn.f_a_proj.weight"].T @ t["attn.f_b_proj.weight"].T).view(10, 3, 16) + t["attn.dt_bias"].view(3, 16)
    want = -5.0 * torch.sigmoid(t["attn.A_log"][:3].exp().view(3, 1) * f)
    assert torch.allclose(g, want, atol=1e-6) and bool((g >= -5).all() and (g <= 0).all())


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="reference must run its torch path")
def test_mixer_matches_transformers_layer():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    cfg = KimiLinearConfig(hidden_size=32, linear_attn_config={"num_heads": 3, "head_dim": 16,
                                                               "short_conv_kernel_size": 4}, num_hidden_layers=1)
    opt = KDAOptions.from_hf(cfg.to_dict())
    t = kda_weights(32, opt)
    ref = KimiLinearDeltaAttention(cfg, 0).eval()
    sd = {k.removeprefix("attn."): v for k, v in t.items()}
    sd["conv1d.weight"] = torch.cat([sd.pop(f"{n}_conv1d.weight") for n in "qkv"])
    for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias"):
        sd["forget_gate." + n] = sd.pop(n)
    sd["forget_gate.A_log"] = sd.pop("A_log").view(1, 1, 3, 1)
    ref.load_state_dict(sd)
    x = torch.randn(1, 80, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(x)[0]
    got = run_mixer(KDAMixer(FakeWeights(t), "attn", opt), x[0], [80])
    assert rel_rmse(got, want) < 1e-5
