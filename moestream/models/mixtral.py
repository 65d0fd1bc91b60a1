"""Mixtral (`mixtral`): GQA with rope (optional sliding window); softmax top-k router, always renormalised.

Config, expert layout and model assembly; the math lives in blocks.py and attention.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from moestream.experts.store import PartSpec
from moestream.models.attention import GQAMixer, gqa_dims
from moestream.models.base import ExpertLayout, Family, Layer, ModelContext, softmax_moe, standard_model
from moestream.models.rope import build_rope


@dataclass
class MixtralConfig:
    raw: dict
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    eps: float
    vocab_size: int
    tie: bool
    window: int | None

    @classmethod
    def from_hf(cls, c: dict) -> "MixtralConfig":
        return cls(c, c["num_hidden_layers"], *gqa_dims(c), c["num_local_experts"], c["num_experts_per_tok"],
                   c.get("rms_norm_eps", 1e-5), c["vocab_size"], bool(c.get("tie_word_embeddings", False)),
                   c.get("sliding_window"))


def expert_layout(cfg: MixtralConfig, names: set[str]) -> ExpertLayout:
    base = "model.layers.{layer}.block_sparse_moe.experts."
    if "model.layers.0.block_sparse_moe.experts.gate_up_proj" in names:
        parts = [PartSpec("gate_up", base + "gate_up_proj", fused=True), PartSpec("down", base + "down_proj", fused=True)]
    else:
        parts = [PartSpec(n, base + "{expert}." + w + ".weight") for n, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))]
    return ExpertLayout(parts, cfg.num_experts, cfg.top_k, list(range(cfg.num_layers)))


def build(cfg: MixtralConfig, ctx: ModelContext):
    w = ctx.weights
    rope = build_rope(cfg.raw, cfg.head_dim)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        mixer = GQAMixer(w, p + ".self_attn", cfg.heads, cfg.kv_heads, cfg.head_dim, rope, cfg.eps, window=cfg.window)
        layers.append(Layer(mixer, _moe(cfg, ctx, i), w.get(p + ".input_layernorm.weight"),
                            w.get(p + ".post_attention_layernorm.weight"), cfg.eps))
    return standard_model(ctx, layers, cfg.eps, cfg.vocab_size, cfg.tie)


def _moe(cfg: MixtralConfig, ctx: ModelContext, i: int):
    return softmax_moe(ctx, i, f"model.layers.{i}.block_sparse_moe", cfg.top_k, True)


FAMILY = Family("mixtral", MixtralConfig.from_hf, expert_layout, build)
