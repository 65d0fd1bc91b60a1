"""gpt-oss (`gpt_oss`): GQA with learned sinks, alternating sliding / full attention, YaRN rope, biased router,
clamped interleaved SwiGLU experts with biases.

Config, expert layout (the fused fp32/bf16 tensors `save_pretrained` writes, or the official MXFP4 blocks/scales)
and model assembly. MXFP4 experts are computed from their packed bytes by kernels/quant.py; nothing is requantised.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.errors import UnsupportedModelError
from moestream.experts.store import PartSpec, cached_addresses
from moestream.kernels import cpu
from moestream.kernels.quant import check_mxfp4_scales, mxfp4_linear
from moestream.models.attention import GQAMixer, gqa_dims
from moestream.models.base import ExpertLayout, Family, Layer, ModelContext, routed, router, standard_model
from moestream.models.blocks import BiasedRouter, mxfp4_bf16, routed_group
from moestream.models.rope import build_rope

LAYER_TYPES = ("sliding_attention", "full_attention")
# What GptOssConfig fills in when a config.json leaves rope unspecified.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
ALPHA, LIMIT = 1.702, 7.0


@dataclass
class GptOssConfig:
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
    layer_types: list[str]

    @classmethod
    def from_hf(cls, c: dict) -> "GptOssConfig":
        raw = dict(c)
        raw.setdefault("rope_theta", 150000.0)
        if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
            raw["rope_parameters"] = dict(DEFAULT_ROPE)
        n = c["num_hidden_layers"]
        types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad or len(types) != n:
            raise UnsupportedModelError(f"gpt_oss layer_types must be {n} of {LAYER_TYPES}; got {bad or len(types)}")
        return cls(raw, n, *gqa_dims(c), c["num_local_experts"], c["num_experts_per_tok"],
                   c.get("rms_norm_eps", 1e-5), c["vocab_size"], bool(c.get("tie_word_embeddings", False)),
                   c.get("sliding_window"), list(types))


def expert_layout(cfg: GptOssConfig, names: set[str]) -> ExpertLayout:
    base = "model.layers.{layer}.mlp.experts."
    if "model.layers.0.mlp.experts.gate_up_proj_blocks" in names:
        kinds = ("blocks", "scales", "bias")  # official MXFP4: [E, out, in/32, 16] codes + [E, out, in/32] scales
    else:
        kinds = ("", "bias")  # save_pretrained: [E, in, out] fp32/bf16 (note: transposed vs nn.Linear)
    parts = [PartSpec(f"{proj}_{k}" if k else proj, f"{base}{proj}_proj_{k}" if k else f"{base}{proj}_proj",
                      fused=True) for proj in ("gate_up", "down") for k in kinds]
    return ExpertLayout(parts, cfg.num_experts, cfg.top_k, list(range(cfg.num_layers)))


def clamped_swiglu(u: torch.Tensor) -> torch.Tensor:
    """u [T, 2I] with gate / linear interleaved -> [T, I]: gate*sigmoid(1.702 gate) * (clamp(linear) + 1)."""
    gate, lin = u[..., ::2].clamp(max=LIMIT), u[..., 1::2].clamp(-LIMIT, LIMIT)
    return gate * torch.sigmoid(gate * ALPHA) * (lin + 1)


def _project(x: torch.Tensor, t: dict[str, torch.Tensor], proj: str) -> torch.Tensor:
    """One expert projection plus its bias, from MXFP4 blocks or an [in, out] float matrix."""
    if proj + "_blocks" in t:
        y = mxfp4_linear(x, t[proj + "_blocks"], t[proj + "_scales"], bf16=mxfp4_bf16())
    else:
        y = x @ t[proj].float()  # [T, in] @ [in, out]
    return y + t[proj + "_bias"].float()


def expert_fn(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    return _project(clamped_swiglu(_project(x, t, "gate_up")), t, "down")


_PARTS = ("gate_up_blocks", "gate_up_scales", "gate_up_bias", "down_blocks", "down_scales", "down_bias")


def _group_pointers(t, inter: int, hidden: int) -> tuple[int, ...] | None:
    """Addresses of an MXFP4 expert's gate_up / down codes and scales, after checking every part's dtype, shape
    and contiguity (the native call reads every expert with one shape: a malformed one would be read out of
    bounds), else None. Cached on a blob's PartViews (experts.store.cached_addresses)."""
    def make() -> tuple[int, ...] | None:  # (the shapes only when not cached: this runs per expert per step)
        want = {"gate_up_blocks": (2 * inter, hidden // 32, 16), "gate_up_scales": (2 * inter, hidden // 32),
                "gate_up_bias": (2 * inter,), "down_blocks": (hidden, inter // 32, 16),
                "down_scales": (hidden, inter // 32), "down_bias": (hidden,)}
        ok = all(n in t and tuple(t[n].shape) == shape and t[n].is_contiguous()
                 and (t[n].dtype == torch.uint8) == (not n.endswith("bias")) for n, shape in want.items())
        return tuple(t[n].data_ptr() for n in _PARTS if not n.endswith("bias")) if ok else None

    return cached_addresses(t, "gpt_oss", make)


def expert_group(x, ids, weights, experts, tensors, out, counts=None) -> bool:
    """The runner's grouped call for a layer step's resident MXFP4 experts: each row through its routed experts,
    gate_up of all of them in one native call and down of all in another (kernels.cpu.linear_mxfp4_ptrs), the
    biases and clamped SwiGLU between, an expert's rows the same bits as expert_fn gives them; experts of more
    rows than the native kernel takes go through expert_fn inside it. Declines (the runner then goes expert by
    expert) without the native kernels, for float experts (save_pretrained's layout) or parts of other shapes."""
    first = tensors[0]
    if x.requires_grad or not cpu.available() or "gate_up_blocks" not in first or x.shape[1] % 32:
        return False
    hidden, inter = x.shape[1], first["gate_up_blocks"].shape[0] // 2
    ptrs = [_group_pointers(t, inter, hidden) for t in tensors]
    if inter % 32 or any(p is None for p in ptrs):
        return False
    bf16 = mxfp4_bf16()

    def native(xr: torch.Tensor, y: torch.Tensor, few: list[tuple[int, int, int]]) -> None:
        # every row of xr has a place in gu / h; the rows of experts not in `few` are left unused
        slot = torch.cat([torch.full((c,), i, dtype=torch.long) for i, (_, _, c) in enumerate(few)])
        at = torch.cat([torch.arange(s, s + c) for _, s, c in few])
        tokens = [c for _, _, c in few]

        def project(src: torch.Tensor, dst: torch.Tensor, part: int, name: str) -> None:
            """dst[at] = src[at] @ W^T + bias for the `name` projection of each expert in `few` (its codes and
            scales ptrs[j][part], ptrs[j][part + 1])."""
            n, k, sp, dp = dst.shape[1], src.shape[1], src.data_ptr(), dst.data_ptr()
            bad = cpu.linear_mxfp4_ptrs([sp + s * k * 4 for _, s, _ in few], tokens, [ptrs[j][part] for j, _, _ in few],
                                        [ptrs[j][part + 1] for j, _, _ in few], [dp + s * n * 4 for _, s, _ in few],
                                        n, k, bf16=bf16)
            if bad >= 0:
                check_mxfp4_scales(tensors[few[bad][0]][f"{name}_scales"])  # raises the 0xFF scale error
            dst[at] += torch.stack([tensors[j][f"{name}_bias"].float() for j, _, _ in few]).index_select(0, slot)

        gu = torch.zeros(xr.shape[0], 2 * inter, dtype=torch.float32)
        project(xr, gu, 0, "gate_up")
        project(clamped_swiglu(gu).contiguous(), y, 2, "down")  # h [R, inter]

    routed_group(x, ids, weights, experts, tensors, out, cpu.MAX_TOKENS_MXFP4, native, expert_fn)
    return True


expert_group.pairs = True  # type: ignore[attr-defined]  # takes the runner's batch-invariant [T, k, D] out


def build(cfg: GptOssConfig, ctx: ModelContext):
    w = ctx.weights
    rope = build_rope(cfg.raw, cfg.head_dim)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        window = cfg.window if cfg.layer_types[i] == "sliding_attention" else None
        mixer = GQAMixer(w, p + ".self_attn", cfg.heads, cfg.kv_heads, cfg.head_dim, rope, cfg.eps,
                         window=window, sinks=True)
        layers.append(Layer(mixer, _moe(cfg, ctx, i), w.get(p + ".input_layernorm.weight"),
                            w.get(p + ".post_attention_layernorm.weight"), cfg.eps))
    return standard_model(ctx, layers, cfg.eps, cfg.vocab_size, cfg.tie)


def _moe(cfg: GptOssConfig, ctx: ModelContext, i: int):
    p = f"model.layers.{i}.mlp.router"
    route = routed(ctx, i, BiasedRouter(router(ctx, p + ".weight"), ctx.weights.get(p + ".bias"), cfg.top_k))

    def ffn(x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(x)  # [T, k]
        return ctx.experts.run(i, x, ids, weights, expert_fn, group=expert_group)

    return ffn


FAMILY = Family("gpt_oss", GptOssConfig.from_hf, expert_layout, build)
