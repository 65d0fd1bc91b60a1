"""Kimi Linear (`kimi_linear`): KDA and NoPE-MLA layers, dense first layers, sigmoid-routed MoE with shared experts.

Config (checkpoint and transformers field names), expert layout and model assembly. The mixers live in kda.py
and mla.py, the router and MLPs in blocks.py; Kimi K3 reuses the mixers with its own variants (spec/kimi-k3.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.experts.store import PartSpec
from moestream.models.base import ExpertLayout, Family, Layer, ModelContext, dense_glu, sigmoid_moe, standard_model
from moestream.models.blocks import expert_glu
from moestream.models.kda import KDAMixer, KDAOptions
from moestream.models.mla import MLAMixer, MLAOptions

FULL, LINEAR = "full_attention", "linear_attention"


def _first(c: dict, names: tuple[str, ...], default=None):
    """The first of several aliases present in the config (checkpoint names vs transformers names)."""
    for n in names:
        if c.get(n) is not None:
            return c[n]
    return default


@dataclass
class KimiLinearConfig:
    raw: dict
    num_layers: int
    layer_types: list[str]  # FULL (MLA) or LINEAR (KDA) per layer
    moe_layers: list[int]  # the others have a dense MLP
    num_experts: int
    top_k: int
    renormalize: bool
    scaling: float
    n_group: int
    topk_group: int
    eps: float
    vocab_size: int
    tie: bool
    mla: MLAOptions
    kda: KDAOptions

    @classmethod
    def from_hf(cls, c: dict) -> "KimiLinearConfig":
        try:
            return cls._parse(c)
        except KeyError as e:
            raise CheckpointError(f"kimi_linear config.json lacks the field {e}") from None

    @classmethod
    def _parse(cls, c: dict) -> "KimiLinearConfig":
        if c.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"kimi_linear with hidden_act {c['hidden_act']!r} is not supported (silu)")
        router = c.get("moe_router_activation_func", "sigmoid")
        if router != "sigmoid":
            raise UnsupportedModelError(f"kimi_linear with a {router!r} router is not supported (sigmoid)")
        n = c["num_hidden_layers"]
        mlp_types = c.get("mlp_layer_types") or ["dense" if i < c.get("first_k_dense_replace", 1) else "sparse"
                                                 for i in range(n)]
        # transformers' defaults: routed_scaling_factor 2.446, renormalise, one expert group (the 48B model's values)
        return cls(c, n, layer_types(c), [i for i, t in enumerate(mlp_types) if t == "sparse"],
                   _first(c, ("num_experts", "num_local_experts", "n_routed_experts"), 256),
                   _first(c, ("num_experts_per_token", "num_experts_per_tok"), 8),
                   bool(_first(c, ("moe_renormalize", "norm_topk_prob"), True)),
                   float(c.get("routed_scaling_factor", 2.446)),
                   _first(c, ("num_expert_group", "n_group"), 1), c.get("topk_group") or 1,
                   c.get("rms_norm_eps", 1e-5), c["vocab_size"], bool(c.get("tie_word_embeddings", False)),
                   MLAOptions.from_hf(c), KDAOptions.from_hf(c))

    @property
    def shared_experts(self) -> int:
        return _first(self.raw, ("num_shared_experts", "n_shared_experts"), 1)


def layer_types(c: dict) -> list[str]:
    """Per-layer mixer kind: `layer_types`, else linear_attn_config's 1-based lists, else transformers' default."""
    n = c["num_hidden_layers"]
    if c.get("layer_types"):
        types = list(c["layer_types"])
    else:
        lac = c.get("linear_attn_config") or {}
        if "full_attn_layers" in lac and "kda_layers" in lac:
            types = [None] * n
            for kind, key in ((FULL, "full_attn_layers"), (LINEAR, "kda_layers")):
                for one_based in lac[key]:
                    if not 1 <= one_based <= n:
                        raise CheckpointError(f"linear_attn_config.{key} names layer {one_based} (1-based) of {n}")
                    types[one_based - 1] = kind
        else:
            # transformers' default puts MLA at 0-based 4, 8, ...; the published 48B config instead lists 1-based
            # 4, 8, ... (0-based 3, 7, ...). Only configs without linear_attn_config lists reach this line.
            types = [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]
    if len(types) != n or any(t not in (FULL, LINEAR) for t in types):
        raise CheckpointError(f"kimi_linear layer types must be {FULL!r} or {LINEAR!r} for all {n} layers: {types}")
    return types


def ffn_module(names, layer: int, leaf: str) -> str:
    """Which module name holds layer `layer`'s FFN tensor `leaf`: `mlp` or `block_sparse_moe`.

    Published checkpoints use `mlp` for dense layers and `block_sparse_moe` for MoE layers; transformers loads
    both as `mlp` and its save_pretrained renames every `.mlp.` back to `.block_sparse_moe.`, dense layers
    included. `names` is anything supporting `in` over tensor names (a set, or DenseWeights)."""
    for module in ("mlp", "block_sparse_moe"):
        if f"model.layers.{layer}.{module}.{leaf}" in names:
            return module
    raise CheckpointError(f"layer {layer}: no model.layers.{layer}.mlp.{leaf} or .block_sparse_moe.{leaf} tensor")


def expert_layout(cfg: KimiLinearConfig, names: set[str]) -> ExpertLayout:
    if not cfg.moe_layers:
        return ExpertLayout([], cfg.num_experts, cfg.top_k, [])
    first = cfg.moe_layers[0]
    base = "model.layers.{layer}." + ffn_module(names, first, "gate.weight") + ".experts."
    if base.format(layer=first) + "gate_up_proj" in names:  # transformers' own fused [E, 2I, H] / [E, H, I]
        parts = [PartSpec("gate_up", base + "gate_up_proj", fused=True),
                 PartSpec("down", base + "down_proj", fused=True)]
    else:  # checkpoints: one w1 (gate), w3 (up), w2 (down) per expert
        parts = [PartSpec(n, f"{base}{{expert}}.{w}.weight") for n, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))]
    return ExpertLayout(parts, cfg.num_experts, cfg.top_k, cfg.moe_layers)


def build(cfg: KimiLinearConfig, ctx: ModelContext):
    w = ctx.weights
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        if cfg.layer_types[i] == FULL:
            mixer = MLAMixer(w, p + ".self_attn", cfg.mla)
        else:
            mixer = KDAMixer(w, p + ".self_attn", cfg.kda)
        if i in cfg.moe_layers:
            ffn = _moe(cfg, ctx, i, f"{p}.{ffn_module(w, i, 'gate.weight')}")
        else:
            ffn = dense_glu(w, f"{p}.{ffn_module(w, i, 'gate_proj.weight')}")
        layers.append(Layer(mixer, ffn, w.get(p + ".input_layernorm.weight"),
                            w.get(p + ".post_attention_layernorm.weight"), cfg.eps))
    return standard_model(ctx, layers, cfg.eps, cfg.vocab_size, cfg.tie)


def _moe(cfg: KimiLinearConfig, ctx: ModelContext, i: int, p: str):
    shared = dense_glu(ctx.weights, p + ".shared_experts") if cfg.shared_experts else None
    return sigmoid_moe(ctx, i, p, expert_glu(), cfg.top_k, cfg.renormalize, cfg.scaling, cfg.n_group,
                       cfg.topk_group, shared)


FAMILY = Family("kimi_linear", KimiLinearConfig.from_hf, expert_layout, build)
