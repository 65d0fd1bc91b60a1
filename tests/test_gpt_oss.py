"""gpt-oss parity with transformers: fused fp32 experts as save_pretrained writes them, and the official MXFP4
layout."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import group_on_and_off, prompt_ids
from moestream import Engine

VOCAB = 160


def tiny_config(**kw):
    from transformers import GptOssConfig

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=12, num_experts_per_tok=3, sliding_window=16,
                max_position_embeddings=512, eos_token_id=None, pad_token_id=0,
                rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    base.update(kw)
    return GptOssConfig(**base)


def tiny_model(seed: int = 0):
    """A random model whose biases, sinks and expert pre-activations are large enough to exercise every branch
    (the +-7 clamps, the sink logit, the router bias)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            ex.gate_up_proj.normal_(0, 0.6)
            ex.gate_up_proj_bias.normal_(0, 1.0)
            ex.down_proj.normal_(0, 0.1)
            ex.down_proj_bias.normal_(0, 0.1)
            layer.mlp.router.weight.normal_(0, 0.3)
            layer.mlp.router.bias.normal_(0, 0.5)
            layer.self_attn.sinks.normal_(0, 1.0)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def fp32_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_fp32")
    model = tiny_model()
    model.save_pretrained(path)
    return path, model


def test_clamp_is_exercised(fp32_ckpt):
    """Guard: the tiny model really drives gate/linear past +-7, so the clamp is tested."""
    _, model = fp32_ckpt
    x = torch.randn(32, 64)
    u = x @ model.model.layers[0].mlp.experts.gate_up_proj[0] + model.model.layers[0].mlp.experts.gate_up_proj_bias[0]
    assert (u.abs() > 7).any()


def test_fp32_parity(fp32_ckpt, check_parity):
    path, model = fp32_ckpt
    out = check_parity(path, model, VOCAB)
    print("gpt_oss fp32", out["max_rel_logit_diff"], out["stats"]["expert_hit_rate"])


def test_batched_matches_single(fp32_ckpt):
    """Two sequences in one step (crossing the sliding window) give each sequence's own logits."""
    path, _ = fp32_ckpt
    eng = Engine.open(path)
    a, b = prompt_ids(VOCAB, 40, seed=3), prompt_ids(VOCAB, 23, seed=4)
    sa, sb = eng.new_sequence(), eng.new_sequence()
    la, lb = eng.step([(sa, a), (sb, b)])
    assert torch.allclose(la, eng.logits(a)[-1], atol=1e-4)
    assert torch.allclose(lb, eng.logits(b)[-1], atol=1e-4)


def test_unknown_layer_type_is_a_clear_error():
    from moestream.errors import UnsupportedModelError
    from moestream.models.gpt_oss import GptOssConfig

    cfg = tiny_config().to_dict()
    cfg["layer_types"] = ["chunked_attention"] * 3
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        GptOssConfig.from_hf(cfg)


def _mxfp4_round_trip(w_out_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] fp32 -> (blocks [out, in/32, 16], scales [out, in/32], the dequantised fp32 [out, in])."""
    from moestream.kernels.quant import dequant_mxfp4, quantize_mxfp4

    packed, scales = quantize_mxfp4(w_out_in)
    return packed.view(w_out_in.shape[0], -1, 16), scales, dequant_mxfp4(packed, scales)


def write_mxfp4_checkpoint(model, path) -> None:
    """Round the model's experts to MXFP4 (and expert biases to bf16) in place, then write the official layout:
    `*_blocks` / `*_scales` per fused expert tensor, bf16 biases, quantization_config {"quant_method": "mxfp4"}."""
    tensors = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex, p = layer.mlp.experts, f"model.layers.{i}.mlp.experts."
            for proj in ("gate_up_proj", "down_proj"):
                weight = getattr(ex, proj)  # [E, in, out]
                rounded = [_mxfp4_round_trip(weight[e].T.contiguous()) for e in range(weight.shape[0])]
                tensors[p + proj + "_blocks"] = torch.stack([r[0] for r in rounded])  # [E, out, in/32, 16]
                tensors[p + proj + "_scales"] = torch.stack([r[1] for r in rounded])  # [E, out, in/32]
                weight.copy_(torch.stack([r[2].T for r in rounded]))
                bias = getattr(ex, proj + "_bias")
                bias.copy_(bias.bfloat16().float())
                tensors[p + proj + "_bias"] = bias.bfloat16().contiguous()
    for name, t in model.state_dict().items():
        if ".mlp.experts." not in name:
            tensors[name] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    model.config.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router"]}
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def mxfp4_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = tiny_model(seed=5)
    write_mxfp4_checkpoint(model, path)
    return path, model


def test_mxfp4_layout_is_official(mxfp4_ckpt):
    path, _ = mxfp4_ckpt
    t = load_file(str(path / "model.safetensors"))
    assert t["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (12, 128, 2, 16)
    assert t["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    assert t["model.layers.0.mlp.experts.gate_up_proj_scales"].shape == (12, 128, 2)
    assert t["model.layers.0.mlp.experts.down_proj_blocks"].shape == (12, 64, 2, 16)
    assert t["model.layers.0.mlp.experts.down_proj_bias"].dtype == torch.bfloat16
    assert not any(n.endswith("gate_up_proj") for n in t)


def kv_fraction(path) -> float:
    """conftest's budget is sized by expert bytes; packed experts are so small that the KV cache (the parity run's
    75 + 32 tokens, grown GROW_TOKENS rows at a time) would not fit, so add its share to the expert fraction to
    keep ~30% of the experts cached."""
    from moestream.engine.engine import plan
    from moestream.server.prefix import rows_at

    kv = 3 * 2 * rows_at(75, 75 + 32, 75) * 2 * 16 * 4  # layers * (k, v) * rows * kv_heads * head_dim * fp32
    return 0.3 + kv / plan(path).expert_bytes


def test_mxfp4_parity(mxfp4_ckpt, check_parity):
    path, model = mxfp4_ckpt
    out = check_parity(path, model, VOCAB, fraction=kv_fraction(path))
    print("gpt_oss mxfp4", out["max_rel_logit_diff"], out["stats"]["bytes_read"])


def test_mxfp4_streams_packed_bytes(mxfp4_ckpt):
    """An expert is its packed bytes (about 4.25 bits a weight plus bf16 biases), never an expanded copy."""
    path, _ = mxfp4_ckpt
    from moestream.engine.engine import plan

    gate_up = 128 * 64 // 2 + 128 * 2 + 128 * 2  # codes + scales + bf16 bias
    down = 64 * 64 // 2 + 64 * 2 + 64 * 2
    assert plan(path).store.expert_nbytes(2, 11) == gate_up + down


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_grouped_experts_are_the_one_by_one_bits(mxfp4_ckpt, monkeypatch, compute):
    """A step's resident MXFP4 experts in two native calls (gpt_oss.expert_group: gate_up of all, biases and the
    clamped SwiGLU, down of all) give the same logits, to the bit, as expert by expert: prefill (experts of more
    rows than the native kernel takes go one by one inside it), a batched step and decode, in fp32 and bf16
    compute."""
    from moestream.kernels import cpu
    from moestream.models import gpt_oss

    if not cpu.available():
        pytest.skip("no native kernels here")
    path, _ = mxfp4_ckpt
    calls = []
    real = cpu.linear_mxfp4_ptrs
    monkeypatch.setattr(cpu, "linear_mxfp4_ptrs", lambda *a, **kw: calls.append(len(a[0])) or real(*a, **kw))
    # 200 tokens: 50 rows an expert on average, past the native kernel's 32 for some
    group_on_and_off(lambda: Engine.open(path, compute_dtype=compute), VOCAB, calls,
                     lambda: monkeypatch.setattr(gpt_oss, "expert_group", lambda *a, **kw: False), 200, 40)
