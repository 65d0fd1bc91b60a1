"""Synthetic DeepSeek-V3 checkpoints in the published layout: block-FP8 (e4m3 codes + a float32 `weight_scale_inv`
per 128 x 128 tile) for every attention, dense-MLP, shared-expert and routed-expert linear; bf16 embeddings,
norms, router and lm_head; the float32 router correction bias; per-expert tensor names.

Owns the V3 shapes per preset (REAL is the published config; `full-width` keeps it and reduces only the layer
count: first dense layers, then MoE layers), the config.json builder and the per-tensor random inits. Codes fill
the e4m3 range as a quantiser's would (block max near 448) and each tile's scale_inv sets the weight's scale, so
activations stay about unit RMS through the layers. Bytes are written by synth/writer.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from moestream.synth.families import (FULL_WIDTH, TRANSFORMERS_VERSION, Preset, SpecialIds, SynthFamily, TensorSpec,
                                      random_bytes)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
CODE_STD = 112.0  # a tile of 128 x 128 normal codes then peaks near 4 std = 448, the quantiser's block max


@dataclass(frozen=True)
class V3Dims:
    hidden: int
    layers: int
    vocab: int
    intermediate: int  # dense layers' MLP
    moe_intermediate: int
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    shared: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    first_dense: int
    block: int  # FP8 tile edge


REAL = V3Dims(7168, 61, 129280, 18432, 2048, 256, 8, 8, 4, 1, 128, 1536, 512, 128, 64, 128, 3, 128)


def dims_for(p: Preset) -> V3Dims:
    if p.name == FULL_WIDTH:  # published widths; with N layers the first min(3, N - 1) stay dense
        return V3Dims(**{**REAL.__dict__, "layers": p.layers, "vocab": p.vocab,
                         "first_dense": min(REAL.first_dense, p.layers - 1)})
    h, e = p.hidden, p.experts
    groups = 4 if e % 4 == 0 else 1
    # FP8 tiles: the published 128 from hidden 1024, 64 from 512 (the native kernel's widths: plan's overhead probe),
    # 32 below (ragged tiles in the tiny test checkpoints)
    return V3Dims(h, p.layers, p.vocab, 3 * h, p.moe_intermediate, e, p.top_k, groups, max(1, groups // 2), 1,
                  p.heads, max(16, h // 4), max(16, h // 8), p.head_dim, p.head_dim // 2, p.head_dim, 1,
                  128 if h >= 1024 else 64 if h >= 512 else 32)


def v3_config(d: V3Dims, ids: SpecialIds) -> dict:
    """The published config.json's fields (no auto_map: nothing here is code to run)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001, "bos_token_id": ids.bos, "eos_token_id": ids.eos, "ep_size": 1,
        "first_k_dense_replace": d.first_dense, "hidden_act": "silu", "hidden_size": d.hidden,
        "initializer_range": 0.02, "intermediate_size": d.intermediate, "kv_lora_rank": d.kv_lora,
        "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": d.moe_intermediate,
        "moe_layer_freq": 1, "n_group": d.n_group, "n_routed_experts": d.experts, "n_shared_experts": d.shared,
        "norm_topk_prob": True, "num_attention_heads": d.heads, "num_experts_per_tok": d.top_k,
        "num_hidden_layers": d.layers, "num_key_value_heads": d.heads, "num_nextn_predict_layers": 0,
        "pretraining_tp": 1, "q_lora_rank": d.q_lora, "qk_nope_head_dim": d.nope, "qk_rope_head_dim": d.rope,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [d.block, d.block]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": d.topk_group, "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16", "transformers_version": TRANSFORMERS_VERSION, "use_cache": True,
        "v_head_dim": d.v, "vocab_size": d.vocab,
    }


def preset_config(p: Preset, ids: SpecialIds) -> dict:
    return v3_config(dims_for(p), ids)


# ---- random inits (shape, generator) -> fp32 -------------------------------------------------------------------
def _code_table() -> torch.Tensor:
    """256 e4m3 codes at the quantiles of N(0, CODE_STD): a uniform random byte indexes a normal-like code (a
    randn per weight would take most of an hour for a full-width layer's experts)."""
    p = (torch.arange(256, dtype=torch.float64) + 0.5) / 256
    values = torch.erfinv(2 * p - 1) * math.sqrt(2) * CODE_STD
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


CODE_TABLE = _code_table().numpy()


def _codes(shape, gen) -> torch.Tensor:
    # numpy indexes by uint8 directly (torch would need an int64 copy of the indices: 6x slower)
    return torch.from_numpy(CODE_TABLE[random_bytes(shape, gen).numpy()]).view(FP8)


def _scale_inv(std: float):
    """Per-tile scale_inv so that codes x scale_inv have about `std` (tiles vary by up to 25% either way)."""
    return lambda shape, gen: (std / CODE_STD) * torch.exp(torch.empty(shape).uniform_(-0.22, 0.22, generator=gen))


def _normal(std: float, mean: float = 0.0):
    return lambda shape, gen: torch.randn(shape, generator=gen) * std + mean


def _fp8_linear(name: str, out_f: int, in_f: int, block: int, gain: float = 1.0) -> Iterator[TensorSpec]:
    """`name.weight` as e4m3 codes and `name.weight_scale_inv` [ceil(out/block), ceil(in/block)] float32."""
    yield TensorSpec(f"{name}.weight", (out_f, in_f), _codes, FP8)
    yield TensorSpec(f"{name}.weight_scale_inv", (math.ceil(out_f / block), math.ceil(in_f / block)),
                     _scale_inv(gain / math.sqrt(in_f)), torch.float32)


def _norm(name: str, n: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", (n,), _normal(0.05, 1.0))


def _mla(p: str, d: V3Dims) -> Iterator[TensorSpec]:
    h, b = d.hidden, d.block
    yield from _fp8_linear(f"{p}.q_a_proj", d.q_lora, h, b)
    yield _norm(f"{p}.q_a_layernorm", d.q_lora)
    yield from _fp8_linear(f"{p}.q_b_proj", d.heads * (d.nope + d.rope), d.q_lora, b)
    yield from _fp8_linear(f"{p}.kv_a_proj_with_mqa", d.kv_lora + d.rope, h, b)
    yield _norm(f"{p}.kv_a_layernorm", d.kv_lora)
    yield from _fp8_linear(f"{p}.kv_b_proj", d.heads * (d.nope + d.v), d.kv_lora, b)
    yield from _fp8_linear(f"{p}.o_proj", h, d.heads * d.v, b)


def _glu(p: str, h: int, inter: int, block: int) -> Iterator[TensorSpec]:
    yield from _fp8_linear(f"{p}.gate_proj", inter, h, block)
    yield from _fp8_linear(f"{p}.up_proj", inter, h, block)
    yield from _fp8_linear(f"{p}.down_proj", h, inter, block)


def layer_tensors(d: V3Dims, i: int) -> Iterator[TensorSpec]:
    """Layer i in the published order: norms, attention, then the dense MLP or router, shared and routed
    experts (each expert's six tensors together, as in the published shards)."""
    p = f"model.layers.{i}"
    yield _norm(f"{p}.input_layernorm", d.hidden)
    yield from _mla(f"{p}.self_attn", d)
    yield _norm(f"{p}.post_attention_layernorm", d.hidden)
    if i < d.first_dense:
        yield from _glu(f"{p}.mlp", d.hidden, d.intermediate, d.block)
        return
    yield TensorSpec(f"{p}.mlp.gate.weight", (d.experts, d.hidden), "router")
    yield TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (d.experts,), _normal(0.1), torch.float32)
    yield from _glu(f"{p}.mlp.shared_experts", d.hidden, d.moe_intermediate * d.shared, d.block)
    for e in range(d.experts):
        yield from _glu(f"{p}.mlp.experts.{e}", d.hidden, d.moe_intermediate, d.block)


def dims_from_config(c: dict) -> V3Dims:
    return V3Dims(c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"],
                  c["moe_intermediate_size"], c["n_routed_experts"], c["num_experts_per_tok"], c["n_group"],
                  c["topk_group"], c["n_shared_experts"], c["num_attention_heads"], c["q_lora_rank"],
                  c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                  c["first_k_dense_replace"], c["quantization_config"]["weight_block_size"][0])


def v3_tensors(config: dict) -> Iterator[TensorSpec]:
    d = dims_from_config(config)
    yield TensorSpec("model.embed_tokens.weight", (d.vocab, d.hidden), "embed")
    for i in range(d.layers):
        yield from layer_tensors(d, i)
    yield _norm("model.norm", d.hidden)
    yield TensorSpec("lm_head.weight", (d.vocab, d.hidden), "proj")


SYNTH = SynthFamily("deepseek_v3", preset_config, v3_tensors, aliases=("deepseek-v3", "dsv3"), full_vocab=REAL.vocab)
