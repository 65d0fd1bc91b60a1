"""What a checkpoint costs, from its safetensors headers alone (no tensor data is read).

Owns the size report behind `moestream info`: total and active parameters, bytes of dense weights and of routed
experts, the expert bytes one token reads with a cold cache, and under a RAM budget the residency plan (which
dense layers stay resident, which stream) and how many experts the rest can cache. Counting
rules for packed formats: a uint8 `*_packed` / `*_blocks` byte holds 2 weights (MXFP4 / int4), an int32
`*_packed` word holds 8 (int4); scale, zero-point and shape tensors of quantised weights are not parameters.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from moestream.config import read_model_config
from moestream.engine.engine import ModelPlan, plan
from moestream.engine.residency import ResidencyPlan, plan_residency
from moestream.errors import BudgetError
from moestream.weights.index import TensorInfo

_NOT_PARAMS = ("scale", "scales", "scale_inv", "zero_point", "weight_shape")
_PACKED = {"U8": 2, "I8": 2, "I32": 8}  # logical weights per stored element of a packed tensor


def tensor_params(info: TensorInfo) -> int:
    """Logical parameters a stored tensor holds (0 for quantisation metadata)."""
    leaf = info.name.rsplit(".", 1)[-1]
    if leaf.endswith(_NOT_PARAMS):
        return 0
    numel = 1
    for s in info.shape:
        numel *= s
    if leaf.endswith(("_packed", "_blocks")):
        return numel * _PACKED.get(info.dtype, 1)
    return numel


@dataclass
class BudgetFit:
    ram_budget: int
    min_ram_budget: int  # every dense layer streamed + compute scratch + one expert: below this open() refuses
    cache_bytes: int  # what the budget leaves for experts (KV / recurrent state grows into it with context)
    resident_bytes_per_expert: float  # an expert's buffer in the cache (payload plus read alignment)
    experts_fit: int
    experts_total: int
    fraction: float  # experts_fit / experts_total
    residency: ResidencyPlan | None = None  # what stays resident and what streams (None: the budget is too small)

    @property
    def fits(self) -> bool:
        return self.ram_budget >= self.min_ram_budget


@dataclass
class ModelInfo:
    path: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_experts: int  # routed experts per MoE layer
    top_k: int
    moe_layers: list[int]
    total_params: int
    active_params: int  # what a token is multiplied through: dense minus the embedding lookup, plus top_k experts
    embedding_params: int  # the input embedding table (a row lookup; counted as active only when tied to the head)
    dense_params: int
    expert_params: int
    dense_bytes: int
    expert_bytes: int  # on disk, all routed experts
    bytes_per_expert: float  # on disk, mean over all routed experts
    expert_bytes_per_token_cold: int  # sum over MoE layers of top_k * expert bytes
    scratch_bytes: int
    min_ram_budget: int  # the smallest budget the engine opens with (dense layers streamed)
    all_resident_budget: int = 0  # the smallest budget keeping every dense weight resident (top_k experts cached)
    total_bytes: int = 0  # dense + routed experts, on disk (text model only)
    config_only: bool = False  # sized from config.json through the family's tensor inventory (no shards present)
    expert_codec: str | None = None  # how a pack stores its routed experts beyond their dtype ("b12"), else None
    dense_coded: tuple[int, int, int] = (0, 0, 0)  # a pack's b12-coded dense matrices: (count, bytes, bytes as bf16)
    budget: BudgetFit | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        if self.budget is not None:
            out["budget"]["fits"] = self.budget.fits
            r = self.budget.residency
            out["budget"]["residency"] = r.to_json() if r is not None else None
        return out


def model_info(path: str | Path, ram_budget: int | None = None) -> ModelInfo:
    p = plan(path)
    try:
        return info_from_plan(path, p, ram_budget)
    finally:
        p.store.close()


def info_from_plan(path: str | Path, p: ModelPlan, ram_budget: int | None = None) -> ModelInfo:
    """model_info of a checkpoint already planned (the caller keeps `p` open, e.g. to fit several budgets)."""
    return _build(path, p, ram_budget)


def _expert_codec(p: ModelPlan) -> str | None:
    """The coding every part of a routed expert is stored in (`pack --codec b12`), or None (stored as its dtype,
    or parts differing)."""
    if not p.layout.moe_layers:
        return None
    codecs = {loc.codec for loc in p.store.locate(p.layout.moe_layers[0], 0)}
    return codecs.pop() if len(codecs) == 1 else None


def budget_fit(info: ModelInfo, p: ModelPlan, ram_budget: int, state_room: int = 0,
               head_rows: bool = True) -> BudgetFit:
    """The residency plan and expert cache of one more budget for a checkpoint `info` describes (keeping
    `state_room` for sequence state when deciding which dense layers stream, as `--state-room` does; `head_rows`
    as EngineOptions.head_rows)."""
    n_experts = info.num_experts * len(info.moe_layers)
    return _fit(info, p, ram_budget, n_experts, p.expert_bytes / max(1, n_experts), state_room, head_rows)


def _build(path: str | Path, p: ModelPlan, ram_budget: int | None) -> ModelInfo:
    raw = read_model_config(path)
    text = raw.get("text_config") or raw  # multimodal checkpoints nest the language model's fields
    index, layout = p.store.index, p.layout
    wanted = [n for n in index.names() if p.family.wants(n)]
    total = sum(tensor_params(index[n]) for n in wanted)
    expert_total = sum(tensor_params(index[n]) for n in wanted if p.store.is_expert_tensor(n))
    embedding = _embedding_params(p, wanted)
    e = max(1, layout.num_experts)
    active_experts = sum(layout.top_k * _layer_expert_params(p, layer) / e for layer in layout.moe_layers)
    per_layer = [_layer_expert_bytes(p, layer) for layer in layout.moe_layers]
    cold = sum(layout.top_k * b / e for b in per_layer)
    n_experts = layout.num_experts * len(layout.moe_layers)
    unlimited = plan_residency(p, None)
    min_budget = unlimited.min_ram_budget
    info = ModelInfo(
        str(path), raw.get("model_type", "?"), int(text.get("num_hidden_layers", 0)),
        int(text.get("hidden_size", 0)), layout.num_experts, layout.top_k, list(layout.moe_layers), total,
        round(total - expert_total - embedding + active_experts), embedding, total - expert_total, expert_total,
        p.dense_bytes,
        sum(per_layer), sum(per_layer) / max(1, n_experts), round(cold), p.scratch_bytes, min_budget)
    info.all_resident_budget = unlimited.all_resident_budget
    info.total_bytes = info.dense_bytes + info.expert_bytes
    info.config_only = index.virtual
    info.expert_codec = _expert_codec(p)
    coded = [index[n] for n in p.dense_names if index[n].codec is not None]
    info.dense_coded = (len(coded), sum(t.nbytes for t in coded), sum(2 * t.shape[0] * t.shape[1] for t in coded))
    if ram_budget is not None:
        info.budget = budget_fit(info, p, ram_budget)
    return info


def _embedding_params(p: ModelPlan, wanted: list[str]) -> int:
    """The embedding table's parameters, or 0 when it doubles as the output head (tied, no lm_head tensor)."""
    index = p.store.index
    if not any(n.endswith("lm_head.weight") for n in wanted):
        return 0
    return sum(tensor_params(index[n]) for n in wanted if n.endswith("embed_tokens.weight"))


def _layer_tensors(p: ModelPlan, layer: int) -> list[TensorInfo]:
    """The routed-expert tensors of one layer (a fused tensor holds all of the layer's experts)."""
    out, index = [], p.store.index
    for part in p.layout.parts:
        experts = [0] if part.fused else range(p.layout.num_experts)
        for e in experts:
            name = p.family.prefix + part.tensor.format(layer=layer, expert=e)
            if name in index:
                out.append(index[name])
    return out


def _layer_expert_params(p: ModelPlan, layer: int) -> int:
    return sum(tensor_params(info) for info in _layer_tensors(p, layer))


def _layer_expert_bytes(p: ModelPlan, layer: int) -> int:
    """On-disk bytes of one layer's experts (the store's resident size may add read-alignment padding)."""
    return sum(loc.nbytes for e in range(p.layout.num_experts) for loc in p.store.locate(layer, e))


def _fit(info: ModelInfo, p: ModelPlan, budget: int, n_experts: int, resident_per_expert: float,
         state_room: int = 0, head_rows: bool = True) -> BudgetFit:
    try:
        residency = plan_residency(p, budget, state_room, head_rows)
    except BudgetError:
        residency = None
    cache = max(0, residency.cache_bytes) if residency is not None else 0
    fit = min(n_experts, int(cache // resident_per_expert)) if resident_per_expert > 0 else 0
    return BudgetFit(budget, info.min_ram_budget, cache, resident_per_expert, fit, n_experts,
                     fit / max(1, n_experts), residency)
