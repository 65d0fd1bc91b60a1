"""Qwen3-MoE (`qwen3_moe`): GQA with per-head q/k RMSNorm and rope; softmax top-k router; SiLU-GLU experts.

Config, expert layout and model assembly; the math lives in blocks.py and attention.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from moestream.errors import UnsupportedModelError
from moestream.experts.store import PartSpec
from moestream.models.attention import GQAMixer, gqa_dims
from moestream.models.base import (ExpertLayout, Family, Layer, ModelContext, dense_glu, softmax_moe,
                                   standard_model)
from moestream.models.rope import build_rope


@dataclass
class Qwen3MoeConfig:
    raw: dict
    hidden_size: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    eps: float
    vocab_size: int
    tie: bool
    moe_layers: list[int]

    @classmethod
    def from_hf(cls, c: dict) -> "Qwen3MoeConfig":
        if c.get("use_sliding_window"):
            raise UnsupportedModelError("qwen3_moe with use_sliding_window=true is not supported yet")
        n = c["num_hidden_layers"]
        experts = c.get("num_experts", c.get("num_local_experts", 0))
        step, dense_only = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
        moe = [i for i in range(n) if i not in dense_only and experts > 0 and (i + 1) % step == 0]
        return cls(c, c["hidden_size"], n, *gqa_dims(c), experts, c["num_experts_per_tok"],
                   bool(c.get("norm_topk_prob", False)), c.get("rms_norm_eps", 1e-6), c["vocab_size"],
                   bool(c.get("tie_word_embeddings", False)), moe)


def expert_layout(cfg: Qwen3MoeConfig, names: set[str]) -> ExpertLayout:
    base = "model.layers.{layer}.mlp.experts."
    first = cfg.moe_layers[0] if cfg.moe_layers else 0
    if f"model.layers.{first}.mlp.experts.gate_up_proj" in names:
        parts = [PartSpec("gate_up", base + "gate_up_proj", fused=True), PartSpec("down", base + "down_proj", fused=True)]
    else:
        parts = [PartSpec(n, base + "{expert}." + n + "_proj.weight") for n in ("gate", "up", "down")]
    return ExpertLayout(parts, cfg.num_experts, cfg.top_k, cfg.moe_layers)


def build(cfg: Qwen3MoeConfig, ctx: ModelContext):
    w = ctx.weights
    rope = build_rope(cfg.raw, cfg.head_dim)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        mixer = GQAMixer(w, p + ".self_attn", cfg.heads, cfg.kv_heads, cfg.head_dim, rope, cfg.eps, qk_norm=True)
        ffn = _moe(cfg, ctx, i) if i in cfg.moe_layers else dense_glu(w, p + ".mlp")
        layers.append(Layer(mixer, ffn, w.get(p + ".input_layernorm.weight"),
                            w.get(p + ".post_attention_layernorm.weight"), cfg.eps))
    return standard_model(ctx, layers, cfg.eps, cfg.vocab_size, cfg.tie)


def _moe(cfg: Qwen3MoeConfig, ctx: ModelContext, i: int):
    return softmax_moe(ctx, i, f"model.layers.{i}.mlp", cfg.top_k, cfg.norm_topk_prob)


FAMILY = Family("qwen3_moe", Qwen3MoeConfig.from_hf, expert_layout, build)
