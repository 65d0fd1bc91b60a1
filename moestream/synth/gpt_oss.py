"""Synthetic gpt-oss checkpoints in the published layout: MXFP4 routed experts (`*_blocks` [E, out, in/32, 16] and
E8M0 `*_scales` [E, out, in/32] per fused gate_up / down tensor, bf16 biases), bf16 attention with biases and
per-head sinks, a biased router, alternating sliding / full attention.

Owns the gpt-oss shapes per preset (REAL is gpt-oss-120b's config; `full-width` keeps it and reduces only the layer
count, and optionally the vocabulary), the config.json builder and the per-tensor random inits. Expert codes are
uniform random E2M1 pairs; each block's scale sets the weight's scale, so activations stay finite. Bytes are
written by synth/writer.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from moestream.synth.families import (FULL_WIDTH, TRANSFORMERS_VERSION, Preset, SpecialIds, SynthFamily, TensorSpec,
                                      mxfp4_codes, mxfp4_scales)


@dataclass(frozen=True)
class OssDims:
    hidden: int
    layers: int
    vocab: int
    intermediate: int  # each expert's (gpt-oss has no dense MLP)
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int


REAL = OssDims(2880, 36, 201088, 2880, 128, 4, 64, 8, 64, 128)  # gpt-oss-120b


def dims_for(p: Preset) -> OssDims:
    if p.name == FULL_WIDTH:
        return replace(REAL, layers=p.layers, vocab=p.vocab)
    return OssDims(p.hidden, p.layers, p.vocab, p.moe_intermediate, p.experts, p.top_k, p.heads, p.kv_heads,
                   p.head_dim, 16 if p.name == "tiny" else 128)


def oss_config(d: OssDims, ids: SpecialIds) -> dict:
    """The fields transformers' GptOssConfig writes, plus the published quantization_config."""
    return {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "bos_token_id": ids.bos, "dtype": "bfloat16", "eos_token_id": ids.eos, "head_dim": d.head_dim,
        "hidden_act": "silu", "hidden_size": d.hidden, "initializer_range": 0.02, "intermediate_size": d.intermediate,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(d.layers)],
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": d.heads,
        "num_experts_per_tok": d.top_k, "num_hidden_layers": d.layers, "num_key_value_heads": d.kv_heads,
        "num_local_experts": d.experts, "output_router_logits": False, "pad_token_id": ids.pad,
        "quantization_config": {"quant_method": "mxfp4",
                                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"]},
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_theta": 150000.0, "rope_type": "yarn",
                            "truncate": False},
        "router_aux_loss_coef": 0.9, "sliding_window": d.window, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION, "use_cache": True, "vocab_size": d.vocab,
    }


def preset_config(p: Preset, ids: SpecialIds) -> dict:
    return oss_config(dims_for(p), ids)


def _normal(std: float, mean: float = 0.0):
    return lambda shape, gen: torch.randn(shape, generator=gen) * std + mean


def _experts(p: str, d: OssDims) -> Iterator[TensorSpec]:
    """gate_up: rows of std 2/sqrt(H), so some gates pass the +-7 clamp; down: 0.3/sqrt(I), so the top-k sum keeps
    the residual stream near unit scale."""
    for proj, out_f, in_f, gain, bias in (("gate_up_proj", 2 * d.intermediate, d.hidden, 2.0, 0.5),
                                          ("down_proj", d.hidden, d.intermediate, 0.3, 0.02)):
        yield TensorSpec(f"{p}.{proj}_blocks", (d.experts, out_f, in_f // 32, 16), mxfp4_codes, torch.uint8)
        yield TensorSpec(f"{p}.{proj}_scales", (d.experts, out_f, in_f // 32),
                         mxfp4_scales(gain / math.sqrt(in_f)), torch.uint8)
        yield TensorSpec(f"{p}.{proj}_bias", (d.experts, out_f), _normal(bias))


def _attention(p: str, d: OssDims) -> Iterator[TensorSpec]:
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    for name, out_f, in_f in (("q_proj", q, d.hidden), ("k_proj", kv, d.hidden), ("v_proj", kv, d.hidden),
                              ("o_proj", d.hidden, q)):
        yield TensorSpec(f"{p}.{name}.weight", (out_f, in_f), "proj")
        yield TensorSpec(f"{p}.{name}.bias", (out_f,), _normal(0.05))
    yield TensorSpec(f"{p}.sinks", (d.heads,), _normal(1.0))


def layer_tensors(d: OssDims, i: int) -> Iterator[TensorSpec]:
    p = f"model.layers.{i}"
    yield TensorSpec(f"{p}.input_layernorm.weight", (d.hidden,), _normal(0.05, 1.0))
    yield from _attention(f"{p}.self_attn", d)
    yield TensorSpec(f"{p}.post_attention_layernorm.weight", (d.hidden,), _normal(0.05, 1.0))
    yield TensorSpec(f"{p}.mlp.router.weight", (d.experts, d.hidden), "router")
    yield TensorSpec(f"{p}.mlp.router.bias", (d.experts,), _normal(0.05))
    yield from _experts(f"{p}.mlp.experts", d)


def dims_from_config(c: dict) -> OssDims:
    return OssDims(c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"],
                   c["num_local_experts"], c["num_experts_per_tok"], c["num_attention_heads"],
                   c["num_key_value_heads"], c["head_dim"], c["sliding_window"])


def oss_tensors(config: dict) -> Iterator[TensorSpec]:
    d = dims_from_config(config)
    yield TensorSpec("model.embed_tokens.weight", (d.vocab, d.hidden), "embed")
    for i in range(d.layers):
        yield from layer_tensors(d, i)
    yield TensorSpec("model.norm.weight", (d.hidden,), "ones")
    yield TensorSpec("lm_head.weight", (d.vocab, d.hidden), "proj")


SYNTH = SynthFamily("gpt_oss", preset_config, oss_tensors, aliases=("gpt-oss", "gptoss"), full_vocab=REAL.vocab)
