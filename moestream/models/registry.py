"""Family registry: Hugging Face `model_type` -> the module implementing it, imported lazily.

Owns the list of supported families and the error for an unknown one. Each family module exposes
`build(cfg: dict, ctx: ModelContext) -> DecoderModel` and `expert_parts(cfg) -> (parts, num_experts, moe_layers,
top_k)` through its `FAMILY` object.
"""
from __future__ import annotations

import importlib

from moestream.errors import UnsupportedModelError

FAMILIES: dict[str, str] = {
    "qwen3_moe": "moestream.models.qwen3_moe",
    "mixtral": "moestream.models.mixtral",
    "kimi_linear": "moestream.models.kimi_linear",
    "kimi_k3": "moestream.models.kimi_k3",
    "gpt_oss": "moestream.models.gpt_oss",
    "deepseek_v3": "moestream.models.deepseek_v3",
    "kimi_k2": "moestream.models.deepseek_v3",
    "kimi_k25": "moestream.models.deepseek_v3",
}


def family_for(cfg: dict):
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))}"
        )
    module = importlib.import_module(FAMILIES[model_type])
    # a module serving several model types (deepseek_v3: kimi_k2, kimi_k25) may name a Family per type
    return getattr(module, "VARIANTS", {}).get(model_type, module.FAMILY)
