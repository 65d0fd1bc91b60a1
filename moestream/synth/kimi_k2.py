"""Synthetic Kimi K2 Thinking checkpoints in the published layout: routed experts int4 pack-quantized
(compressed-tensors: `weight_packed` int32 words of eight 4-bit codes stored as value + 8, `weight_scale` one bf16
scale per 32 inputs, `weight_shape` the int32 [out, in]), every other linear bf16 (attention, dense MLP, shared
expert, lm_head), the router's correction bias float32; per-expert tensor names.

Owns the K2 shapes per preset (REAL is Kimi K2's published config: hidden 7168, 64 MLA heads, 384 experts of width
2048, top-8 without groups, one dense layer first), the config.json builder and the per-tensor random inits; the
tensor list itself is models/deepseek_v3.py's inventory (the one the engine's `info` / `plan` price), and bytes are
written by synth/writer.py. Codes are uniform over -8..7 and each group's scale sets the weight's scale, so
activations stay about unit RMS through the layers.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterator

import torch

from moestream.models.deepseek_v3 import DeepseekV3Config, inventory
from moestream.synth.deepseek_v3 import V3Dims, v3_config
from moestream.synth.families import FULL_WIDTH, Preset, SpecialIds, SynthFamily, TensorSpec, random_bytes

# Kimi K2 (Instruct / Thinking share the shapes): the last field (the FP8 tile) is unused here
REAL = V3Dims(7168, 61, 163840, 18432, 2048, 384, 8, 1, 1, 1, 64, 1536, 512, 128, 64, 128, 1, 128)
GROUP = 32
INT4_RMS = math.sqrt(sum(v * v for v in range(-8, 8)) / 16)  # of uniformly random codes, -8..7
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32}
QUANT = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                              "group_size": GROUP, "num_bits": 4, "observer": "minmax",
                                              "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                              "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                          "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def dims_for(p: Preset) -> V3Dims:
    if p.name == FULL_WIDTH:  # published widths; with N layers the first min(1, N - 1) stays dense
        return replace(REAL, layers=p.layers, vocab=p.vocab, first_dense=min(REAL.first_dense, p.layers - 1))
    h = p.hidden
    return V3Dims(h, p.layers, p.vocab, 3 * h, p.moe_intermediate, p.experts, p.top_k, 1, 1, 1, p.heads,
                  max(32, h // 4), max(32, h // 8), p.head_dim, p.head_dim // 2, p.head_dim, 1, GROUP)


def k2_config(d: V3Dims, ids: SpecialIds) -> dict:
    """Kimi K2 Thinking's config.json fields (no auto_map: nothing here is code to run)."""
    c = v3_config(d, ids)
    c.update({"model_type": "kimi_k2", "quantization_config": QUANT, "routed_scaling_factor": 2.827,
              "rope_theta": 50000.0, "max_position_embeddings": 262144,
              "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0,
                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}})
    return c


def preset_config(p: Preset, ids: SpecialIds) -> dict:
    return k2_config(dims_for(p), ids)


# ---- random inits (shape, generator) -> values -----------------------------------------------------------------
def _packed(shape, gen) -> torch.Tensor:
    """int32 words of eight uniform random 4-bit codes."""
    return random_bytes((*shape, 4), gen).view(torch.int32).reshape(shape)


def _group_scale(in_features: int):
    """bf16 group scales so that code x scale has about 1 / sqrt(in) (groups vary by up to 25% either way)."""
    std = 1.0 / math.sqrt(in_features)
    return lambda shape, gen: (std / INT4_RMS) * torch.exp(torch.empty(shape).uniform_(-0.22, 0.22, generator=gen))


def _normal(std: float, mean: float = 0.0):
    return lambda shape, gen: torch.randn(shape, generator=gen) * std + mean


def _spec(name: str, shape: tuple[int, ...], dtype: str, inv: dict) -> TensorSpec:
    t = DTYPES[dtype]
    if name.endswith(".weight_packed"):
        return TensorSpec(name, shape, _packed, t)
    if name.endswith(".weight_scale"):
        return TensorSpec(name, shape, _group_scale(shape[1] * GROUP), t)
    if name.endswith(".weight_shape"):
        rows, words = inv[name[:-len("shape")] + "packed"][0]  # the int32 [out, in] of its packed words
        return TensorSpec(name, shape, lambda s, g: torch.tensor([rows, words * 8], dtype=torch.int32), t)
    if name == "model.embed_tokens.weight":
        return TensorSpec(name, shape, "embed", t)
    if name.endswith(".mlp.gate.weight"):
        return TensorSpec(name, shape, "router", t)
    if name.endswith(".e_score_correction_bias"):
        return TensorSpec(name, shape, _normal(0.1), t)
    if len(shape) == 1:  # norms
        return TensorSpec(name, shape, _normal(0.05, 1.0), t)
    return TensorSpec(name, shape, "proj", t)


def k2_tensors(config: dict) -> Iterator[TensorSpec]:
    inv = inventory(DeepseekV3Config.from_hf(config))
    for name, (shape, dtype) in inv.items():
        yield _spec(name, tuple(shape), dtype, inv)


SYNTH = SynthFamily("kimi_k2", preset_config, k2_tensors, aliases=("kimi-k2",), full_vocab=REAL.vocab)
