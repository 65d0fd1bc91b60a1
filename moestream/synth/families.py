"""Per-family random-checkpoint layouts: the config.json transformers would write and the tensor inventory.

Owns the size presets (tiny / small / medium) and a table of `SynthFamily` entries, one per Hugging Face
model_type. A family that lives in its own file (e.g. a Kimi K3 synth) registers with one line in
`EXTRA_MODULES`; that module exposes `SYNTH = SynthFamily(...)`. Writing bytes is writer.py's job.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Union

import torch

from moestream.errors import MoestreamError

# The transformers release whose save_pretrained output these configs reproduce (the test oracle's version).
TRANSFORMERS_VERSION = "5.17.0"


@dataclass(frozen=True)
class Preset:
    """Family-neutral sizes; each family maps them onto its own config fields."""

    name: str
    hidden: int
    layers: int
    experts: int
    top_k: int
    moe_intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    shard_bytes: int  # target shard size, chosen so every preset writes several shards


PRESETS: dict[str, Preset] = {
    # about 1.6 MB in bf16: the test preset
    "tiny": Preset("tiny", 64, 4, 16, 2, 64, 512, 4, 2, 16, 512 * 1024),
    # about 420 MB (qwen3_moe): the demo preset
    "small": Preset("small", 512, 8, 64, 4, 256, 4096, 8, 4, 64, 96 * 2**20),
    # about 3.3 GB (qwen3_moe)
    "medium": Preset("medium", 1024, 16, 64, 8, 512, 8192, 16, 4, 64, 768 * 2**20),
    # every tensor at the published model's shape and dtype (the family's own REAL dims); only the layer count
    # (--layers, required) and optionally the vocabulary (--vocab) are reduced. Widths here are unused.
    "full-width": Preset("full-width", 0, 0, 0, 0, 0, 0, 0, 0, 0, 4 << 30),
}
FULL_WIDTH = "full-width"

# An init is a named scheme (see writer.init_tensor) or a function (shape, generator) -> fp32 tensor.
Init = Union[str, Callable[[tuple[int, ...], torch.Generator], torch.Tensor]]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: Init  # "proj" (std 1/sqrt(fan_in)), "ones", "zeros", "router", "embed" (unit RMS rows)
    dtype: torch.dtype | None = None  # None: the checkpoint's dtype (bf16); fp32 where the real model keeps fp32

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def random_bytes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Uniform random uint8 of `shape`, drawn 8 bytes at a time (18x faster than randint per byte: full-width
    checkpoints hold tens of GB of packed codes)."""
    n = 1
    for s in shape:
        n *= s
    words = torch.randint(-2**63, 2**63 - 1, ((n + 7) // 8,), generator=gen, dtype=torch.int64)
    return words.view(torch.uint8)[:n].reshape(shape)


E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of uniformly random codes


def mxfp4_codes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Packed MXFP4 bytes: two uniform random E2M1 codes per byte."""
    return random_bytes(shape, gen)


def mxfp4_scales(target_std: float) -> Callable[[tuple[int, ...], torch.Generator], torch.Tensor]:
    """An init of E8M0 scale bytes around the exponent giving weights of about `target_std` with uniform codes
    (one block in three a step off either way)."""
    base = 127 + round(math.log2(target_std / E2M1_RMS))
    return lambda shape, gen: (base + torch.randint(-1, 2, shape, generator=gen)).float()


@dataclass(frozen=True)
class SpecialIds:
    """Token ids the config must name, taken from the trained tokenizer."""

    bos: int
    eos: int
    pad: int | None = None


@dataclass(frozen=True)
class SynthFamily:
    model_type: str
    config: Callable[[Preset, SpecialIds], dict]  # the config.json dict
    tensors: Callable[[dict], Iterator[TensorSpec]]  # from that config dict
    aliases: tuple[str, ...] = ()
    full_vocab: int | None = None  # the published vocabulary: set where a full-width layout exists


def _hf_common(p: Preset, ids: SpecialIds, architecture: str, model_type: str) -> dict:
    return {
        "architectures": [architecture], "attention_dropout": 0.0, "bos_token_id": ids.bos, "dtype": "bfloat16",
        "eos_token_id": ids.eos, "head_dim": p.head_dim, "hidden_act": "silu", "hidden_size": p.hidden,
        "initializer_range": 0.02, "model_type": model_type, "num_attention_heads": p.heads,
        "num_hidden_layers": p.layers, "num_key_value_heads": p.kv_heads, "pad_token_id": ids.pad,
        "tie_word_embeddings": False, "transformers_version": TRANSFORMERS_VERSION, "use_cache": True,
        "vocab_size": p.vocab,
    }


def _gqa(prefix: str, c: dict, qk_norm: bool) -> Iterator[TensorSpec]:
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    yield TensorSpec(f"{prefix}.q_proj.weight", (q, h), "proj")
    yield TensorSpec(f"{prefix}.k_proj.weight", (kv, h), "proj")
    yield TensorSpec(f"{prefix}.v_proj.weight", (kv, h), "proj")
    yield TensorSpec(f"{prefix}.o_proj.weight", (h, q), "proj")
    if qk_norm:
        yield TensorSpec(f"{prefix}.q_norm.weight", (hd,), "ones")
        yield TensorSpec(f"{prefix}.k_norm.weight", (hd,), "ones")


def _glu(prefix: str, names: tuple[str, str, str], hidden: int, inter: int) -> Iterator[TensorSpec]:
    gate, up, down = names
    yield TensorSpec(f"{prefix}.{gate}.weight", (inter, hidden), "proj")
    yield TensorSpec(f"{prefix}.{up}.weight", (inter, hidden), "proj")
    yield TensorSpec(f"{prefix}.{down}.weight", (hidden, inter), "proj")


def _ends(c: dict) -> tuple[list[TensorSpec], list[TensorSpec]]:
    h, v = c["hidden_size"], c["vocab_size"]
    head = [TensorSpec("model.norm.weight", (h,), "ones"), TensorSpec("lm_head.weight", (v, h), "proj")]
    return [TensorSpec("model.embed_tokens.weight", (v, h), "embed")], head


# ---- qwen3_moe ----------------------------------------------------------------------------------------------
def qwen3_moe_config(p: Preset, ids: SpecialIds) -> dict:
    c = _hf_common(p, ids, "Qwen3MoeForCausalLM", "qwen3_moe")
    c.update({
        "attention_bias": False, "decoder_sparse_step": 1, "intermediate_size": 3 * p.hidden,
        "max_position_embeddings": 32768, "mlp_only_layers": [], "moe_intermediate_size": p.moe_intermediate,
        "norm_topk_prob": True, "num_experts_per_tok": p.top_k, "num_local_experts": p.experts,
        "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "use_sliding_window": False,
    })
    return c


def _gqa_moe_tensors(c: dict, moe: str, projs: tuple[str, str, str], inter: int,
                     qk_norm: bool) -> Iterator[TensorSpec]:
    """Every tensor of a GQA + routed-MoE decoder (Qwen3-MoE, Mixtral): `moe` is the MoE module's name,
    `projs` the expert's gate / up / down tensor names."""
    h, e = c["hidden_size"], c["num_local_experts"]
    first, last = _ends(c)
    yield from first
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield TensorSpec(f"{p}.input_layernorm.weight", (h,), "ones")
        yield from _gqa(f"{p}.self_attn", c, qk_norm=qk_norm)
        yield TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "ones")
        yield TensorSpec(f"{p}.{moe}.gate.weight", (e, h), "router")
        for j in range(e):
            yield from _glu(f"{p}.{moe}.experts.{j}", projs, h, inter)
    yield from last


def qwen3_moe_tensors(c: dict) -> Iterator[TensorSpec]:
    return _gqa_moe_tensors(c, "mlp", ("gate_proj", "up_proj", "down_proj"), c["moe_intermediate_size"], True)


# ---- mixtral ------------------------------------------------------------------------------------------------
def mixtral_config(p: Preset, ids: SpecialIds) -> dict:
    c = _hf_common(p, ids, "MixtralForCausalLM", "mixtral")
    c.update({
        "intermediate_size": p.moe_intermediate, "max_position_embeddings": 32768,
        "num_experts_per_tok": p.top_k, "num_local_experts": p.experts, "output_router_logits": False,
        "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "sliding_window": None,
    })
    return c


def mixtral_tensors(c: dict) -> Iterator[TensorSpec]:
    return _gqa_moe_tensors(c, "block_sparse_moe", ("w1", "w3", "w2"), c["intermediate_size"], False)


# ---- kimi_linear ------------------------------------------------------------------------------------------
def kimi_linear_config(p: Preset, ids: SpecialIds) -> dict:
    """Kimi Linear 48B's shape at preset scale: MLA (NoPE, direct q_proj) at every fourth layer (1-based) and
    always the last, KDA elsewhere; layer 0 dense; one shared expert."""
    n, rope = p.layers, p.head_dim // 2
    full = sorted({*range(4, n + 1, 4), n})
    c = _hf_common(p, ids, "KimiLinearForCausalLM", "kimi_linear")
    c.update({
        "attention_bias": False, "first_k_dense_replace": 1, "head_dim": rope, "intermediate_size": 4 * p.hidden,
        "kv_lora_rank": max(16, p.hidden // 4), "num_key_value_heads": p.heads,
        "layer_types": ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)],
        "linear_attn_config": {"full_attn_layers": full, "head_dim": p.head_dim,
                               "kda_layers": [i for i in range(1, n + 1) if i not in full], "num_heads": p.heads,
                               "short_conv_kernel_size": 4},
        "linear_conv_kernel_dim": 4, "linear_head_dim": p.head_dim, "linear_num_heads": p.heads,
        "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1), "model_max_length": 1048576,
        "moe_intermediate_size": p.moe_intermediate, "moe_renormalize": True, "num_expert_group": 1,
        "num_experts": p.experts, "num_experts_per_token": p.top_k, "num_shared_experts": 1, "pretraining_tp": 1,
        "q_lora_rank": None, "qk_head_dim": p.head_dim + rope, "qk_nope_head_dim": p.head_dim,
        "qk_rope_head_dim": rope, "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.446, "topk_group": 1,
        "v_head_dim": p.head_dim,
    })
    return c


def _a_log(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return (1 + 15 * torch.rand(shape, generator=gen)).log()  # decay rates in [1, 16], as FLA initialises them


def _dt_bias(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(shape, generator=gen))
    return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt): time steps in [0.001, 0.1]


def _small(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return 0.05 * torch.randn(shape, generator=gen)


def _kda(prefix: str, c: dict) -> Iterator[TensorSpec]:
    lac, h = c["linear_attn_config"], c["hidden_size"]
    heads, hd, k = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    w = heads * hd
    for s in "qkv":
        yield TensorSpec(f"{prefix}.{s}_proj.weight", (w, h), "proj")
        yield TensorSpec(f"{prefix}.{s}_conv1d.weight", (w, 1, k), "proj", torch.float32)
    for g in "fg":  # low-rank decay (f) and output gate (g) projections
        yield TensorSpec(f"{prefix}.{g}_a_proj.weight", (hd, h), "proj")
        yield TensorSpec(f"{prefix}.{g}_b_proj.weight", (w, hd), "proj")
    yield TensorSpec(f"{prefix}.A_log", (1, 1, heads, 1), _a_log, torch.float32)
    yield TensorSpec(f"{prefix}.dt_bias", (w,), _dt_bias, torch.float32)
    yield TensorSpec(f"{prefix}.b_proj.weight", (heads, h), "proj")
    yield TensorSpec(f"{prefix}.o_norm.weight", (hd,), "ones", torch.float32)
    yield TensorSpec(f"{prefix}.o_proj.weight", (h, w), "proj")


def _mla(prefix: str, c: dict) -> Iterator[TensorSpec]:
    h, heads, lora = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    yield TensorSpec(f"{prefix}.q_proj.weight", (heads * (nope + rope), h), "proj")
    yield TensorSpec(f"{prefix}.kv_a_proj_with_mqa.weight", (lora + rope, h), "proj")
    yield TensorSpec(f"{prefix}.kv_a_layernorm.weight", (lora,), "ones")
    yield TensorSpec(f"{prefix}.kv_b_proj.weight", (heads * (nope + v), lora), "proj")
    yield TensorSpec(f"{prefix}.o_proj.weight", (h, heads * v), "proj")


def kimi_linear_tensors(c: dict) -> Iterator[TensorSpec]:
    """The published checkpoint's names: dense layers under `mlp.`, MoE layers under `block_sparse_moe.`."""
    h, inter, e = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"]
    first, last = _ends(c)
    yield from first
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}"
        yield TensorSpec(f"{p}.input_layernorm.weight", (h,), "ones")
        yield from (_mla if kind == "full_attention" else _kda)(f"{p}.self_attn", c)
        yield TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "ones")
        if c["mlp_layer_types"][i] == "dense":
            yield from _glu(f"{p}.mlp", ("gate_proj", "up_proj", "down_proj"), h, c["intermediate_size"])
            continue
        m = f"{p}.block_sparse_moe"
        yield TensorSpec(f"{m}.gate.weight", (e, h), "router")
        yield TensorSpec(f"{m}.gate.e_score_correction_bias", (e,), _small, torch.float32)
        yield from _glu(f"{m}.shared_experts", ("gate_proj", "up_proj", "down_proj"), h,
                        inter * c["num_shared_experts"])
        for j in range(e):
            yield from _glu(f"{m}.experts.{j}", ("w1", "w3", "w2"), h, inter)
    yield from last


SYNTHS: dict[str, SynthFamily] = {
    "qwen3_moe": SynthFamily("qwen3_moe", qwen3_moe_config, qwen3_moe_tensors, ("qwen3-moe", "qwen3moe")),
    "mixtral": SynthFamily("mixtral", mixtral_config, mixtral_tensors),
    "kimi_linear": SynthFamily("kimi_linear", kimi_linear_config, kimi_linear_tensors, ("kimi-linear",)),
}

# Families defined in their own modules (each exposes SYNTH): register here with one line.
EXTRA_MODULES: dict[str, str] = {
    "kimi_k3": "moestream.synth.kimi_k3",
    "deepseek_v3": "moestream.synth.deepseek_v3",
    "kimi_k2": "moestream.synth.kimi_k2",
    "gpt_oss": "moestream.synth.gpt_oss",
}


def register(family: SynthFamily) -> SynthFamily:
    SYNTHS[family.model_type] = family
    return family


def supported() -> list[str]:
    return sorted(set(SYNTHS) | set(EXTRA_MODULES))


def synth_family(name: str) -> SynthFamily:
    """Look a family up by model_type or alias; hyphens and underscores are interchangeable."""
    key = name.strip().lower().replace("-", "_")
    for fam in list(SYNTHS.values()):
        if key == fam.model_type or key in {a.replace("-", "_") for a in fam.aliases}:
            return fam
    if key in EXTRA_MODULES:
        return register(importlib.import_module(EXTRA_MODULES[key]).SYNTH)
    raise MoestreamError(f"no synthetic layout for family {name!r}; choose from {', '.join(supported())} "
                         "(hyphens work too, e.g. qwen3-moe)")


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise MoestreamError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]
