"""Synthetic Kimi K3 checkpoints: the official multimodal layout (`language_model.` prefix, text_config, 1-based
layer lists, compressed-tensors MXFP4 experts, fp32 where the real one is fp32) at reduced dimensions.

Owns the K3 shapes per preset, the config.json builder (the same builder reproduces the real config from
`REAL`), and the per-tensor random inits; the tensor list itself is models/kimi_k3.py's inventory, and bytes
are written by synth/writer.py. A few random vision tensors are included; the engine must never read them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from moestream.models.kimi_k3 import PREFIX, KimiK3Config, expert_tensors, layer_dense_tensors, top_tensors
from moestream.synth.families import (FULL_WIDTH, TRANSFORMERS_VERSION, Preset, SpecialIds, SynthFamily, TensorSpec,
                                      mxfp4_codes, mxfp4_scales)

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}


@dataclass(frozen=True)
class K3Dims:
    hidden: int
    layers: int
    vocab: int
    block: int  # attn_res_block_size
    intermediate: int  # layer 0's dense MLP
    experts: int
    top_k: int
    moe_intermediate: int
    latent: int  # routed_expert_hidden_size
    shared: int
    heads: int  # MLA heads
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    kda_heads: int
    kda_dim: int


REAL = K3Dims(7168, 93, 163840, 12, 33792, 896, 16, 3072, 3584, 2, 96, 1536, 512, 128, 64, 128, 96, 128)
# K3-specific shapes per preset; hidden, vocab and widths come from the shared Preset. Like the real model
# (93% of its bytes are routed experts), small and medium are dominated by experts: tiny ~1.5 MB (the test
# preset), small ~360 MB, medium ~2.9 GB.
_SHAPES = {
    # 8 layers, AttnRes blocks of 2 (seals at 0, 2, 4, 6), MLA at 0-based 3, 6, 7
    "tiny": dict(layers=8, block=2, top_k=4, experts=16),
    "small": dict(layers=12, block=4, top_k=8, experts=256),
    "medium": dict(layers=24, block=6, top_k=8, experts=256),
}


def dims_for(p: Preset) -> K3Dims:
    if p.name == FULL_WIDTH:  # the published widths; only layers (and optionally the vocabulary) reduced
        return replace(REAL, layers=p.layers, vocab=p.vocab)
    s = _SHAPES.get(p.name, dict(layers=max(p.layers, 6), block=3, top_k=p.top_k, experts=p.experts))
    h = p.hidden
    return K3Dims(h, s["layers"], p.vocab, s["block"], 4 * h, s["experts"], s["top_k"], p.moe_intermediate,
                  max(32, h // 2), 2, p.heads, max(16, h // 4), max(16, h // 8), p.head_dim, p.head_dim // 2,
                  p.head_dim, p.heads, p.head_dim)


def full_attn_layers(n: int) -> list[int]:
    """1-based: every fourth layer, and the last two (K3: 4, 8, ..., 92, 93)."""
    return sorted({i for i in range(4, n + 1, 4)} | {n - 1, n})


def text_config(d: K3Dims, ids: SpecialIds) -> dict:
    full = full_attn_layers(d.layers)
    return {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": d.vocab,
        "hidden_size": d.hidden, "intermediate_size": d.intermediate, "moe_intermediate_size": d.moe_intermediate,
        "num_hidden_layers": d.layers, "num_attention_heads": d.heads, "num_key_value_heads": d.heads,
        "q_lora_rank": d.q_lora, "kv_lora_rank": d.kv_lora, "qk_nope_head_dim": d.nope, "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v, "mla_use_nope": True, "mla_use_output_gate": True, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-05,
        "model_max_length": 1048576, "max_position_embeddings": 1048576, "attn_res_block_size": d.block,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": d.experts,
        "num_experts_per_token": d.top_k, "num_shared_experts": d.shared, "routed_expert_hidden_size": d.latent,
        "latent_moe_use_norm": True, "routed_scaling_factor": 1.0, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1,
        "topk_group": 1, "num_nextn_predict_layers": 0, "tie_word_embeddings": False, "initializer_range": 0.02,
        "use_cache": True, "torch_dtype": "bfloat16", "bos_token_id": ids.bos, "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
        "linear_attn_config": {
            "num_heads": d.kda_heads, "head_dim": d.kda_dim, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True, "full_attn_layers": full,
            "kda_layers": [i for i in range(1, d.layers + 1) if i not in full]},
    }


def quantization_config() -> dict:
    weights = {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True,
               "dynamic": False, "actorder": None, "observer": "minmax", "scale_dtype": "uint8", "zp_dtype": None}
    return {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized", "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*\\.mlp\\.(gate|up|down)_proj$",
                   "re:vision_tower.*", "re:mm_projector.*"],
        "kv_cache_scheme": None,
    }


def k3_config(d: K3Dims, ids: SpecialIds) -> dict:
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "torch_dtype": "bfloat16",
            "bos_token_id": ids.bos, "eos_token_id": ids.eos, "pad_token_id": ids.pad, "tie_word_embeddings": False,
            "text_config": text_config(d, ids), "quantization_config": quantization_config()}


def preset_config(p: Preset, ids: SpecialIds) -> dict:
    c = k3_config(dims_for(p), ids)
    c["transformers_version"] = TRANSFORMERS_VERSION
    return c


# ---- random inits (shape, generator) -> fp32 ---------------------------------------------------------------
def _normal(std: float, mean: float = 0.0):
    return lambda shape, gen: torch.randn(shape, generator=gen) * std + mean


def _proj(gain: float = 1.0):
    return lambda shape, gen: torch.randn(shape, generator=gen) * (gain / math.sqrt(shape[-1]))


def _a_log(heads: int):
    """Real entries log(U(0.5, 3)) for the first `heads`, zero padding after (as in K3's [128] for 96 heads)."""
    def init(shape, gen):
        t = torch.zeros(shape)
        t[:heads] = torch.log(0.5 + 2.5 * torch.rand(heads, generator=gen))
        return t
    return init


def _conv(shape, gen) -> torch.Tensor:
    t = torch.randn(shape, generator=gen) * 0.3
    t[..., -1] += 1.0  # the current token's tap dominates, as in trained short convs
    return t


def _init_for(name: str, cfg: KimiK3Config):
    """Scales chosen so every K3 mechanism matters: SiTU's tanh saturates (gate inputs std ~3), the latent sum
    is far from unit RMS (so its norm matters), decays range from long to short memory."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
    if name.endswith("weight_packed"):
        return mxfp4_codes
    if name.endswith("weight_scale"):
        fan_in = cfg.latent if ".w2." not in name else cfg.moe_intermediate_size
        return mxfp4_scales((0.2 if ".w2." in name else 3.0) / math.sqrt(fan_in))
    table = {
        "embed_tokens": "embed", "A_log": _a_log(cfg.kda_heads), "dt_bias": _normal(1.0, -3.0),
        "e_score_correction_bias": _normal(0.2), "gate": "router", "gate_proj": _proj(3.0), "up_proj": _proj(3.0),
        "self_attention_res_proj": _proj(2.0), "mlp_res_proj": _proj(2.0), "output_attn_res_proj": _proj(2.0),
        "q_conv1d": _conv, "k_conv1d": _conv, "v_conv1d": _conv, "q_b_proj": _proj(2.0),
    }
    if leaf in table:
        return table[leaf]
    if leaf.endswith("norm") or leaf.endswith("layernorm"):
        return _normal(0.1, 1.0)
    return "proj"


VISION_GARBAGE = _normal(1e4)


def vision_tensors(h: int) -> list[TensorSpec]:
    """Random vision-tower tensors: present in the shards, never to be read by a text engine (at most 1024 wide:
    they stand for the tower, they are not its shape, and full width would add 0.7 GB of noise)."""
    h = min(h, 1024)
    return [TensorSpec("mm_projector.proj.0.weight", (h, 4 * h), VISION_GARBAGE),
            TensorSpec("vision_tower.patch_embed.proj.weight", (h, 3 * 14 * 14), VISION_GARBAGE),
            TensorSpec("vision_tower.encoder.blocks.0.attn.qkv.weight", (3 * h, h), VISION_GARBAGE)]


def k3_tensors(config: dict) -> Iterator[TensorSpec]:
    """Every tensor of the checkpoint in shard order: vision projector, embeddings, layers, head, vision tower."""
    cfg = KimiK3Config.from_hf(config)
    vision = vision_tensors(cfg.hidden_size)
    yield vision[0]  # shares a shard with language tensors: reads must skip it by range, not by file
    top = top_tensors(cfg)
    groups = [{k: top[k] for k in ("model.embed_tokens.weight",)}]
    for layer in range(cfg.num_layers):
        inv = layer_dense_tensors(cfg, layer)
        if layer in cfg.moe_layers:
            for e in range(cfg.num_experts):
                inv.update(expert_tensors(cfg, layer, e))
        groups.append(inv)
    groups.append({k: v for k, v in top.items() if k != "model.embed_tokens.weight"})
    for inv in groups:
        for name, (shape, dtype) in inv.items():
            yield TensorSpec(PREFIX + name, shape, _init_for(name, cfg), DTYPES[dtype])
    yield from vision[1:]


SYNTH = SynthFamily("kimi_k3", preset_config, k3_tensors, aliases=("kimi-k3", "k3"), full_vocab=REAL.vocab)
