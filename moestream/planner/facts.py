"""What the planner needs to know about a checkpoint, from its headers alone (or config.json through the family's
tensor inventory): sizes from moestream.info, the residency plan of a budget, the weight formats a token is
multiplied through, and the shapes that set attention work and sequence state.

Owns the sorting of dense bytes into the kernel each format takes (bf16 native, MXFP4, block FP8, int4, fp32) and
of the lm_head apart (one row per prefill chunk, every row in a batch step). It never reads tensor data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moestream.engine.engine import ModelPlan, plan
from moestream.engine.residency import EMBED, HEAD, layer_of
from moestream.errors import BudgetError
from moestream.info import BudgetFit, ModelInfo, budget_fit, info_from_plan, tensor_params
from moestream.planner.calibrate import DENSE_KINDS, DENSE_SHAPES_MAX, model_widths
from moestream.planner.state import StateShape, state_shape

_KIND = {"BF16": "bf16", "F16": "bf16", "F32": "f32", "F8_E4M3": "fp8", "U8": "mxfp4", "I32": "int4"}


def kind_of(dtype: str) -> str:
    return _KIND.get(dtype, "bf16")


@dataclass
class ModelFacts:
    path: str
    model_type: str
    info: ModelInfo
    num_layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: float  # one routed expert, on disk (mean)
    expert_params: float  # one routed expert's multiplied parameters
    expert_kind: str  # the weight format of routed experts
    dense_bytes: dict[str, int]  # per format: dense bytes one token is multiplied through (lm_head apart)
    dense_params: int  # parameters of those
    head_bytes: int
    head_kind: str
    head_params: int
    attention: list[tuple[int, int, int]]  # per softmax-attention layer: (heads, qk dim, v dim)
    kda: tuple[int, int, int]  # (layers, heads, head dim) of linear-attention layers
    state: StateShape
    hidden: int = 0  # the residual width (the input width of every expert projection)
    widths: dict[str, int] = field(default_factory=dict)  # calibrate.model_widths: the overhead probe's widths
    # the 2-D dense weights a token is multiplied through (lm_head apart): (format, out, in) -> how many
    dense_shapes: dict[tuple[str, int, int], int] = field(default_factory=dict)
    head_shape: tuple[int, int] | None = None  # the lm_head's (out, in)
    expert_codec: str = ""  # how routed experts are stored beyond their format: "b12" (a pack's coded bf16), or ""

    def probe_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) per weight format at which calibration probes its kernel: the routed expert's projection for
        its format (a GLU expert's three matrices: params / 3 / hidden rows), hidden x hidden for dense-only ones."""
        if self.hidden <= 0:
            return {}
        shapes = {k: (self.hidden, self.hidden) for k in self.dense_bytes}
        if self.expert_params:
            shapes[self.expert_kind] = (max(1, round(self.expert_params / 3 / self.hidden)), self.hidden)
        return shapes

    def dense_probe_shapes(self, most: int = DENSE_SHAPES_MAX) -> list[tuple[str, int, int]]:
        """(format, out, in) of the bf16 and block-FP8 dense weights calibration times over many rows: per format
        the `most` shapes holding the most bytes, and the lm_head's."""
        shapes = []
        for kind in DENSE_KINDS:
            own = sorted(((n * o * i, (kind, o, i)) for (k, o, i), n in self.dense_shapes.items() if k == kind),
                         reverse=True)
            shapes += [sh for _, sh in own[:most]]
        if self.head_shape is not None and self.head_kind in DENSE_KINDS:
            shapes.append((self.head_kind, *self.head_shape))
        return list(dict.fromkeys(shapes))

    def glu_shape(self) -> tuple[int, int] | None:
        """(inter, hidden) of a bf16 routed expert (the fused GLU kernel's shape; stored bf16 or b12-coded, which
        `expert_codec` says), else None."""
        if self.expert_kind != "bf16" or not self.expert_params or self.hidden <= 0:
            return None
        return max(1, round(self.expert_params / 3 / self.hidden)), self.hidden

    @property
    def cold_bytes_per_token(self) -> float:
        return self.moe_layers * self.top_k * self.expert_bytes

    def fit(self, p: ModelPlan, budget: int, state_room: int = 0, head_rows: bool = True) -> BudgetFit:
        """The budget's residency plan (keeping `state_room` for state, as `--state-room`; `head_rows` as
        EngineOptions.head_rows) and expert cache; BudgetError when the engine could not open under it."""
        b = budget_fit(self.info, p, budget, state_room, head_rows)
        if b.residency is None and state_room:  # no room for the state as well: plan the engine's default
            b = budget_fit(self.info, p, budget, head_rows=head_rows)
        if not b.fits or b.residency is None:
            raise BudgetError(f"--ram-budget {budget} bytes is too small for {self.path}: the engine needs at least "
                              f"{b.min_ram_budget} bytes (every dense layer streamed, one expert cached)")
        return b


def open_plan(path: str | Path) -> ModelPlan:
    return plan(path)


def model_facts(path: str | Path, p: ModelPlan, kv_dtype: str = "fp32") -> ModelFacts:
    info = info_from_plan(path, p)
    index, prefix, layout = p.store.index, p.family.prefix, p.layout
    n_layers = int(getattr(p.config, "num_layers", info.num_layers))
    dense: dict[str, int] = {}
    dense_params = head_bytes = head_params = 0
    head_kind = "bf16"
    head_shape = None
    shapes: dict[tuple[str, int, int], int] = {}
    tied = not any(n == prefix + HEAD for n in p.dense_names)
    for full in p.dense_names:
        name, t = full[len(prefix):], index[full]
        layer = layer_of(name)
        if layer is not None and layer >= n_layers:
            continue  # multi-token-prediction layers: never loaded
        if name == HEAD or (tied and name == EMBED):
            head_bytes, head_params, head_kind = t.nbytes, tensor_params(t), kind_of(t.dtype)
            head_shape = (int(t.shape[0]), int(t.shape[1])) if len(t.shape) == 2 else None
            continue
        if name == EMBED:
            continue  # a row lookup, not a multiply
        k = kind_of(t.dtype)
        dense[k] = dense.get(k, 0) + t.nbytes
        if len(t.shape) == 2:
            dense_params += tensor_params(t)
            key = (k, int(t.shape[0]), int(t.shape[1]))
            shapes[key] = shapes.get(key, 0) + 1
    locs = p.store.locate(layout.moe_layers[0], 0) if layout.moe_layers else []
    expert_kind = kind_of(max(locs, key=lambda l: l.nbytes).dtype) if locs else "bf16"
    expert_params = sum(tensor_params(index[prefix + part.tensor.format(layer=layout.moe_layers[0], expert=0)])
                        for part in layout.parts if not part.fused) if locs else 0
    if locs and not expert_params:  # a fused layout: the layer's tensor holds every expert
        expert_params = (info.expert_params / max(1, len(layout.moe_layers) * layout.num_experts))
    return ModelFacts(str(path), info.model_type, info, n_layers, len(layout.moe_layers), layout.num_experts,
                      layout.top_k, info.bytes_per_expert, expert_params, expert_kind, dense, dense_params,
                      head_bytes, head_kind, head_params, attention_shapes(p.config, n_layers),
                      kda_shape(p.config, n_layers),
                      state_shape(p.config, kv_dtype), _hidden(p.config),
                      model_widths(getattr(p.config, "raw", None) or {}), shapes, head_shape,
                      info.expert_codec or "")


def _hidden(cfg) -> int:
    return int(getattr(cfg, "hidden_size", 0) or (getattr(cfg, "raw", {}) or {}).get("hidden_size", 0))


def attention_shapes(cfg, n_layers: int) -> list[tuple[int, int, int]]:
    """(heads, qk dim, v dim) per softmax-attention layer (GQA everywhere, or the MLA layers)."""
    raw = getattr(cfg, "raw", {}) or {}
    if hasattr(cfg, "mla_layers"):
        return [(cfg.heads, cfg.nope_dim + cfg.rope_dim, cfg.v_dim)] * len(cfg.mla_layers)
    if hasattr(cfg, "mla") and hasattr(cfg, "layer_types"):
        m = cfg.mla
        full = sum(1 for t in cfg.layer_types if t == "full_attention")
        return [(m.heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)] * full
    if hasattr(cfg, "heads") and hasattr(cfg, "head_dim"):
        return [(cfg.heads, cfg.head_dim, cfg.head_dim)] * n_layers
    heads = int(raw.get("num_attention_heads", 1))
    qk = int(raw.get("qk_nope_head_dim", 128)) + int(raw.get("qk_rope_head_dim", 64))
    return [(heads, qk, int(raw.get("v_head_dim") or 128))] * n_layers


def kda_shape(cfg, n_layers: int) -> tuple[int, int, int]:
    """(layers, heads, head dim) of the linear-attention (KDA) layers; zeros for a model without them."""
    if hasattr(cfg, "mla_layers"):
        return n_layers - len(cfg.mla_layers), cfg.kda_heads, cfg.kda_dim
    if hasattr(cfg, "kda") and hasattr(cfg, "layer_types"):
        return sum(1 for t in cfg.layer_types if t != "full_attention"), cfg.kda.heads, cfg.kda.head_dim
    return 0, 0, 0
