"""Checks a checkpoint's config.json before a family reads it: types and ranges of the fields families use.

Owns the table of known Hugging Face config fields (sizes are positive integers, eps positive numbers, flags
booleans, ...), the cross-field rules (top-k at most the expert count, expert groups that divide the experts), and
`parse_config`, the one place a family's parser runs: a key it needs that is missing, or a value of the wrong
type it trips over, becomes a CheckpointError naming the key instead of a KeyError / TypeError traceback.
Family-specific meaning stays in each family's config dataclass.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from moestream.errors import CheckpointError, MoestreamError
from moestream.weights.validate import is_int

# fields a family reads as sizes: positive integers (None allowed where HF writes null for "unset")
POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "intermediate_size", "moe_intermediate_size", "num_local_experts", "num_experts_per_tok",
            "num_experts_per_token", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "routed_expert_hidden_size", "attn_res_block_size", "n_group", "topk_group", "num_expert_group", "moe_layer_freq",
            "decoder_sparse_step", "sliding_window", "max_position_embeddings", "linear_num_heads",
            "linear_head_dim", "linear_conv_kernel_dim", "num_heads", "short_conv_kernel_size")
NON_NEGATIVE = ("num_experts", "n_routed_experts", "first_k_dense_replace", "num_shared_experts", "n_shared_experts",
                "num_nextn_predict_layers")
POSITIVE_NUMBER = ("rms_norm_eps", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                   "beta_slow")
NUMBER = ("routed_scaling_factor", "activation_situ_beta", "activation_situ_linear_beta", "gate_lower_bound",
          "mscale", "mscale_all_dim", "attention_factor", "low_freq_factor", "high_freq_factor")
BOOLEAN = ("tie_word_embeddings", "norm_topk_prob", "use_sliding_window", "latent_moe_use_norm", "moe_renormalize",
           "mla_use_nope", "mla_use_output_gate", "rope_interleave", "use_full_rank_gate", "truncate")
INT_LISTS = ("mlp_only_layers", "full_attn_layers", "kda_layers")
STR_LISTS = ("layer_types", "mlp_layer_types")
TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id")
OBJECTS = ("text_config", "linear_attn_config", "rope_scaling", "rope_parameters", "quantization_config")
MAX_SIZE = 1 << 24  # no real width, vocabulary or count comes near this (K3: hidden 7168, vocab 163840)
MAX_LAYERS = 1 << 12
MAX_EXPERT_SLOTS = 1 << 20  # layers x experts (K3: 60 x 896); the expert tables are built per (layer, expert)


def check_fields(c: dict, where: str) -> None:
    """Type and range of every known field of `c` and of its nested config objects."""
    for key, value in c.items():
        if value is None:
            continue  # HF writes null for unset optional fields; a family that needs one reports it
        if key in OBJECTS:
            if not isinstance(value, dict):
                raise CheckpointError(f"{where}: {key} must be a JSON object, got {_show(value)}")
            check_fields(value, f"{where} ({key})")
        elif key in POSITIVE or key in NON_NEGATIVE:
            low = 1 if key in POSITIVE else 0
            if not is_int(value) or not low <= value <= MAX_SIZE:
                raise CheckpointError(f"{where}: {key} must be an integer >= {low}, got {_show(value)}")
        elif key in POSITIVE_NUMBER or key in NUMBER:
            if not _number(value) or (key in POSITIVE_NUMBER and value <= 0):
                kind = "a positive number" if key in POSITIVE_NUMBER else "a finite number"
                raise CheckpointError(f"{where}: {key} must be {kind}, got {_show(value)}")
        elif key in BOOLEAN and not isinstance(value, bool):
            raise CheckpointError(f"{where}: {key} must be true or false, got {_show(value)}")
        elif key in INT_LISTS and not (isinstance(value, list) and all(is_int(v) and 0 <= v <= MAX_SIZE
                                                                       for v in value)):
            raise CheckpointError(f"{where}: {key} must be a list of non-negative integers, got {_show(value)}")
        elif key in TOKEN_IDS and not all(is_int(v) and 0 <= v <= MAX_SIZE
                                          for v in (value if isinstance(value, list) else [value])):
            raise CheckpointError(f"{where}: {key} must be a token id or a list of them, got {_show(value)}")
        elif key in STR_LISTS and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise CheckpointError(f"{where}: {key} must be a list of strings, got {_show(value)}")


def check_relations(c: dict, where: str) -> None:
    """Rules between fields of one (text) config."""
    experts = next((c[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if c.get(k)), None)
    top_k = next((c[k] for k in ("num_experts_per_tok", "num_experts_per_token") if c.get(k)), None)
    if experts is not None and top_k is not None and top_k > experts:
        raise CheckpointError(f"{where}: top-k {top_k} (num_experts_per_tok) exceeds the {experts} experts")
    layers = c.get("num_hidden_layers")
    if is_int(layers) and layers > MAX_LAYERS:
        raise CheckpointError(f"{where}: num_hidden_layers {layers} is beyond any supported model (at most "
                              f"{MAX_LAYERS})")
    if is_int(layers) and is_int(experts) and layers * experts > MAX_EXPERT_SLOTS:
        raise CheckpointError(f"{where}: {layers} layers x {experts} experts is beyond any supported model (at "
                              f"most {MAX_EXPERT_SLOTS} expert slots)")
    groups, topk_groups = c.get("n_group") or c.get("num_expert_group"), c.get("topk_group")
    if groups and topk_groups and topk_groups > groups:
        raise CheckpointError(f"{where}: topk_group {topk_groups} exceeds the {groups} expert groups")
    if groups and experts and experts % groups:
        raise CheckpointError(f"{where}: {experts} experts do not split into {groups} groups")


def parse_config(parse: Callable[[dict], Any], raw: dict, root: str | Path) -> Any:
    """Run a family's parser on a checked config; what it still trips over is reported by key."""
    where = f"{Path(root) / 'config.json'}"
    check_fields(raw, where)
    for c in (raw, raw.get("text_config") or {}):
        check_relations(c, where)
    try:
        return parse(raw)
    except MoestreamError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{where}: required key {e.args[0]!r} is missing") from None
    except (TypeError, ValueError, AttributeError, IndexError, OverflowError, ZeroDivisionError) as e:
        raise CheckpointError(f"{where}: malformed value ({type(e).__name__}: {e})") from None


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
