"""DeepSeek-V3 / Kimi K2 / K2.5 parity with transformers' DeepseekV3ForCausalLM on tiny random checkpoints:
float experts as save_pretrained writes them, official block-FP8 (experts and dense), int4 pack-quantized
(Kimi K2), and K2.5's multimodal wrapper (text_config, `language_model.` prefix, a vision tower never read)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import group_on_and_off, prompt_ids
from moestream import Engine
from moestream.kernels.quant import dequant_fp8_block, dequant_int4_packed, pack_int4, quantize_fp8_block

VOCAB = 160
ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.8, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
INT4_QUANT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
              "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}


def tiny_config(**kw):
    from transformers import DeepseekV3Config

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
                qk_nope_head_dim=16, max_position_embeddings=256, rope_parameters=dict(ROPE), eos_token_id=None,
                bos_token_id=None, pad_token_id=0)
    base.update(kw)
    return DeepseekV3Config(**base)


def tiny_model(seed: int = 0, **kw):
    """Random weights, with router weights and correction biases large enough that groups and bias matter."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(tiny_config(**kw)).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.3)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.1)
            layer.mlp.experts.down_proj.normal_(0, 0.1)
    return model


def kv_fraction(path, latent: int = 32) -> float:
    """conftest sizes the budget by expert bytes; packed experts are small enough that the MLA latent cache (the
    parity run's 75 + 32 tokens, grown GROW_TOKENS rows at a time) would not fit, so add its share to keep ~30% of
    the experts cached."""
    from moestream.engine.engine import plan
    from moestream.server.prefix import rows_at

    kv = 3 * rows_at(75, 75 + 32, 75) * (latent + 8) * 4  # layers * rows * (kv_lora_rank + rope dim) * fp32
    return 0.3 + kv / plan(path).expert_bytes


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv3_float")
    model = tiny_model()
    model.save_pretrained(path)
    return path, model


def test_float_parity(float_ckpt, check_parity):
    path, model = float_ckpt
    out = check_parity(path, model, VOCAB)
    print("deepseek_v3 fp32", out["max_rel_logit_diff"], out["stats"]["expert_hit_rate"])


def test_group_limit_and_yarn_are_exercised(float_ckpt):
    """Guards that the test model is not degenerate: groups drop experts, yarn scales cos/sin and the softmax."""
    from moestream.models.deepseek_v3 import DeepseekV3Config, softmax_scale
    from moestream.models.rope import build_rope

    path, model = float_ckpt
    cfg = DeepseekV3Config.from_hf(json.loads((path / "config.json").read_text()))
    assert softmax_scale(cfg) != pytest.approx(24 ** -0.5)
    assert model.model.layers[0].self_attn.scaling == pytest.approx(softmax_scale(cfg))
    rope = build_rope(cfg.raw, 8, interleaved=True)
    assert rope.attention_factor != pytest.approx(1.0)
    assert torch.allclose(rope.inv_freq, model.model.rotary_emb.inv_freq)
    assert rope.attention_factor == pytest.approx(model.model.rotary_emb.attention_scaling)


def test_batched_and_decode_match_prefill(float_ckpt):
    path, _ = float_ckpt
    eng = Engine.open(path)
    a, b = prompt_ids(VOCAB, 30, seed=3), prompt_ids(VOCAB, 17, seed=4)
    full = eng.logits(a)
    sa, sb = eng.new_sequence(), eng.new_sequence()
    la, lb = eng.step([(sa, a[:20]), (sb, b)])
    assert torch.allclose(la, full[19], atol=1e-4) and torch.allclose(lb, eng.logits(b)[-1], atol=1e-4)
    for i in range(20, 30):  # token by token (the absorbed MLA path) continues the batched prefill
        (li,) = eng.step([(sa, [a[i]])])
        assert torch.allclose(li, full[i], atol=1e-4)


# ---- quantised checkpoints: quantise the saved tensors, let the reference load the rounded values ---------------


def _is_fp8_dense(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3's official checkpoint: every linear weight is block-FP8 except embeddings, head and router."""
    return t.dim() == 2 and not any(s in name for s in ("embed_tokens", "lm_head", "mlp.gate.weight"))


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _quantise(src, fmt: str, prefix: str = "", block: tuple[int, int] = (32, 32)) -> tuple[dict, dict]:
    """(stored tensors in the official layout, the same tensors as the dequantised fp32 values)."""
    stored, rounded = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if fmt == "fp8" and _is_fp8_dense(name, t):
            q, s = quantize_fp8_block(t, block)
            stored[prefix + name], stored[prefix + name + "_scale_inv"] = q, s
            rounded[name] = dequant_fp8_block(q, s, block)
        elif fmt == "int4" and _is_expert(name):
            packed, scale = pack_int4(t, 32)
            base = prefix + name[: -len("weight")]
            stored[base + "weight_packed"], stored[base + "weight_scale"] = packed, scale
            stored[base + "weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
            rounded[name] = dequant_int4_packed(packed, scale, 32)
        else:
            stored[prefix + name], rounded[name] = t, t
    return stored, rounded


def _reference_from(rounded: dict, src, path):
    """DeepseekV3ForCausalLM loaded (by transformers itself) from the dequantised tensors."""
    from transformers import DeepseekV3ForCausalLM

    ref_dir = path / "reference"
    ref_dir.mkdir()
    save_file({k: v.contiguous() for k, v in rounded.items()}, str(ref_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (ref_dir / "config.json").write_text((src / "config.json").read_text())
    return DeepseekV3ForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


def _write(path, stored: dict, cfg: dict) -> None:
    save_file({k: v.contiguous() for k, v in stored.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3_fp8")
    src, path = root / "src", root / "ckpt"
    path.mkdir()
    tiny_model(seed=7).save_pretrained(src)
    stored, rounded = _quantise(src, "fp8")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = FP8_QUANT
    _write(path, stored, cfg)
    return path, _reference_from(rounded, src, root)


def test_fp8_layout_is_official(fp8_ckpt):
    path, _ = fp8_ckpt
    t = load_file(str(path / "model.safetensors"))
    w, s = t["model.layers.1.mlp.experts.3.up_proj.weight"], t["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (32, 64) and s.dtype == torch.float32 and s.shape == (1, 2)
    kv_a = t["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert kv_a.shape == (math.ceil(40 / 32), 2)  # ragged last block
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32


def test_fp8_parity(fp8_ckpt, check_parity):
    path, ref = fp8_ckpt
    out = check_parity(path, ref, VOCAB, fraction=kv_fraction(path))
    print("deepseek_v3 fp8", out["max_rel_logit_diff"])


def test_fp8_parity_on_the_native_kernel(tmp_path, check_parity, monkeypatch):
    """64 x 64 blocks and 64-wide MLA heads: the 64-wide weights (q_a, kv_a, o_proj, the dense and expert gate / up)
    of decode steps and short prompts run on the native FP8 kernel (kernels/_cpu_fp8.c), the others chunked, and
    kv_b stays FP8 (its heads on whole blocks: fold and unfold on the native per-head call); parity holds."""
    from moestream.kernels import cpu, quant

    if not quant.fp8_native(1, 64, (64, 64)):
        pytest.skip("no native AVX-512 FP8 kernel here")
    calls, head_calls = [], []
    real, real_heads = cpu.linear_fp8, cpu.linear_fp8_heads
    monkeypatch.setattr(cpu, "linear_fp8", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    monkeypatch.setattr(cpu, "linear_fp8_heads", lambda *a, **kw: head_calls.append(1) or real_heads(*a, **kw))
    group_calls = []
    real_group = cpu.linear_fp8_ptrs
    monkeypatch.setattr(cpu, "linear_fp8_ptrs", lambda *a, **kw: group_calls.append(1) or real_group(*a, **kw))
    path, rounded = _fp8_native_ckpt(tmp_path)
    out = check_parity(path, _reference_from(rounded, tmp_path / "src", tmp_path), VOCAB,
                       fraction=kv_fraction(path, 64))
    print("deepseek_v3 fp8 native", out["max_rel_logit_diff"])
    assert {tuple(s)[1] for s in calls} == {64, 256} and len(calls) > 100 and len(head_calls) > 100  # 256: o_proj
    assert len(group_calls) > 20  # the resident experts of a step: gate and up, then down, of all of them
    heads = Engine.open(path).model.layers[0].mixer.heads
    assert heads.w32 is None and heads.uk_t8 is not None


def _fp8_native_ckpt(tmp_path, seed: int = 7):
    """64 x 64 blocks, 64-wide MLA heads and experts (every expert product on the native kernel's widths)."""
    src, path = tmp_path / "src", tmp_path / "ckpt"
    path.mkdir()
    tiny_model(seed=seed, kv_lora_rank=64, qk_nope_head_dim=64, v_head_dim=64,
               moe_intermediate_size=64).save_pretrained(src)
    stored, rounded = _quantise(src, "fp8", block=(64, 64))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = dict(FP8_QUANT, weight_block_size=[64, 64])
    _write(path, stored, cfg)
    return path, rounded


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_grouped_experts_are_the_one_by_one_bits(tmp_path, monkeypatch, fmt):
    """A step's resident block-FP8 / int4 experts in two native calls (expert_group) give the same logits, to the
    bit, as the same experts one by one, prefill, batched and decode steps alike (a row's sums do not depend on
    the call's other rows, and its experts add in the same order); experts of many rows go one by one inside it."""
    from moestream.kernels import cpu, quant
    from moestream.models import deepseek_v3

    if not quant.fp8_native(1, 64, (64, 64)):
        pytest.skip("no native AVX-512 kernels here")
    path = _fp8_native_ckpt(tmp_path)[0] if fmt == "fp8" else _int4_ckpt(tmp_path, False, moe_intermediate_size=64)[0]
    name = f"linear_{fmt}_ptrs"
    calls = []
    real = getattr(cpu, name)
    monkeypatch.setattr(cpu, name, lambda *a, **kw: calls.append(len(a[0])) or real(*a, **kw))
    # 250 tokens: ~62 rows an expert, fp8's native limit (64) inside the group and past it
    group_on_and_off(lambda: Engine.open(path), VOCAB, calls,
                     lambda: monkeypatch.setattr(deepseek_v3, "expert_group", lambda cfg: (lambda *a, **kw: False)),
                     250, 70)


def test_fp8_dense_stays_fp8_in_ram(fp8_ckpt):
    """Dense FP8 weights are decoded chunk by chunk per use, so the resident dense bytes are the stored bytes, plus
    MLA's kv_b dequantised once to fp32 per head (the absorbed decode's prepared matrices), counted."""
    from moestream.engine.engine import plan

    path, _ = fp8_ckpt
    eng = Engine.open(path)
    cfg = json.loads((path / "config.json").read_text())
    folded = cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["kv_lora_rank"] * 4 \
        * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
    assert eng.memory.dense_bytes == plan(path).dense_bytes + folded
    assert eng.model.layers[0].mixer.q_a.dtype == torch.float8_e4m3fn
    assert eng.model.layers[0].mixer.heads.w32.shape == (cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
                                                         + cfg["v_head_dim"], cfg["kv_lora_rank"])


def test_block_fp8_weight_dequantises_on_float_only():
    from moestream.models.blocks import linear
    from moestream.models.deepseek_v3 import BlockFp8Weight

    w = torch.randn(40, 64)
    q, s = quantize_fp8_block(w, (32, 32))
    wrapped = BlockFp8Weight.wrap(q, s, (32, 32))
    x = torch.randn(5, 64)
    assert torch.allclose(linear(x, wrapped), x @ dequant_fp8_block(q, s, (32, 32)).T, atol=1e-5)
    assert type(wrapped.float()) is torch.Tensor and type(wrapped[:2]) is torch.Tensor


def _int4_ckpt(root, wrap_k25: bool, **kw):
    src, path = root / "src", root / "ckpt"
    path.mkdir()
    tiny_model(seed=11, n_group=1, topk_group=1, q_lora_rank=None, **kw).save_pretrained(src)
    prefix = "language_model." if wrap_k25 else ""
    stored, rounded = _quantise(src, "int4", prefix)
    text = json.loads((src / "config.json").read_text())
    text["model_type"] = "kimi_k2"
    if wrap_k25:
        stored["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.randn(96, 32)
        stored["mm_projector.proj.0.weight"] = torch.randn(64, 128)
        cfg = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": text,
               "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": 32}, "eos_token_id": 3,
               "quantization_config": INT4_QUANT}
    else:
        cfg = dict(text, quantization_config=INT4_QUANT)
    _write(path, stored, cfg)
    return path, _reference_from(rounded, src, root)


def test_int4_kimi_k2_parity(tmp_path, check_parity):
    path, ref = _int4_ckpt(tmp_path, wrap_k25=False)
    t = load_file(str(path / "model.safetensors"))
    assert t["model.layers.2.mlp.experts.0.down_proj.weight_packed"].dtype == torch.int32
    out = check_parity(path, ref, VOCAB, fraction=kv_fraction(path))
    print("kimi_k2 int4", out["max_rel_logit_diff"])


def test_kimi_k25_wrapper_parity(tmp_path, check_parity):
    path, ref = _int4_ckpt(tmp_path, wrap_k25=True)
    out = check_parity(path, ref, VOCAB, fraction=kv_fraction(path))
    eng = Engine.open(path)
    assert eng.eos_token_ids == [3]
    assert not any(n.startswith(("vision_tower", "mm_projector")) for n in eng.plan.dense_names)
    print("kimi_k25 int4", out["max_rel_logit_diff"])


def test_unsupported_router_is_a_clear_error():
    from moestream.errors import UnsupportedModelError
    from moestream.models.deepseek_v3 import DeepseekV3Config

    cfg = tiny_config().to_dict()
    cfg["scoring_func"] = "softmax"
    with pytest.raises(UnsupportedModelError, match="scoring_func"):
        DeepseekV3Config.from_hf(cfg)


def test_inventory_is_the_published_checkpoints(tmp_path, tmp_path_factory):
    """config.json alone sizes a DeepSeek-V3 / Kimi K2 checkpoint: the inventory is the synthesised checkpoint's
    headers (names, shapes, dtypes) and the int4 checkpoint's tensor names and shapes (its dense weights here are
    the test's float32), and `info` on a directory holding only config.json gives the full directory's sizes."""
    from conftest import synth_tiny
    from moestream.info import model_info
    from moestream.models import deepseek_v3 as dv
    from moestream.weights.index import CheckpointIndex

    synth = synth_tiny(tmp_path_factory, "deepseek_v3")
    cfg = json.loads((synth / "config.json").read_text())
    headers = {n: (tuple(t.shape), t.dtype) for n, t in CheckpointIndex.open(synth).tensors.items()}
    inv = dv.inventory(dv.DeepseekV3Config.from_hf(cfg))
    assert {n: (tuple(shape), dtype) for n, (shape, dtype) in inv.items()} == headers
    only = tmp_path / "config_only"
    only.mkdir()
    (only / "config.json").write_text(json.dumps(cfg))
    a, b = model_info(only), model_info(synth)
    assert a.config_only and not b.config_only
    assert (a.dense_bytes, a.bytes_per_expert, a.total_bytes) == (b.dense_bytes, b.bytes_per_expert, b.total_bytes)
    (tmp_path / "k2").mkdir()
    path, _ = _int4_ckpt(tmp_path / "k2", wrap_k25=False)
    k2 = json.loads((path / "config.json").read_text())
    shapes = {n: tuple(t.shape) for n, t in CheckpointIndex.open(path).tensors.items()}
    assert {n: tuple(shape) for n, (shape, _) in dv.inventory(dv.DeepseekV3Config.from_hf(k2)).items()} == shapes
