"""DeepSeek-V3 / Kimi K2 / Kimi K2.5 (`deepseek_v3`, `kimi_k2`, `kimi_k25`): MLA with interleaved YaRN rope,
group-limited sigmoid router with correction bias, first_k_dense_replace dense layers, shared experts.

Config (K2.5's multimodal wrapper unwrapped: text model under `text_config`, tensors under `language_model.`,
vision tower never read), expert layouts (per-expert float, HF-fused float, block-FP8, int4 pack-quantized) and
model assembly. Block-FP8 / int4 dense weights stay as stored (kernels/qweight.py, multiplied in row chunks); MLA
lives in mla.py; the FP8 / int4 arithmetic in kernels/quant.py.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from moestream.errors import UnsupportedModelError
from moestream.experts.store import PartSpec, cached_addresses
from moestream.kernels.qweight import BlockFp8Weight, Int4Weight
from moestream.kernels import cpu
from moestream.kernels.quant import (FP8_BLOCK, FP8_NATIVE_MAX_T, INT4_NATIVE_MAX_T, fp8_block_linear,
                                     int4_linear)
from moestream.models.base import (DenseWeights, ExpertLayout, Family, Layer, ModelContext, dense_glu, sigmoid_moe,
                                   standard_model)
from moestream.models.blocks import expert_glu, glu_group, linear, routed_group
from moestream.models.mla import MLAMixer, MLAOptions
from moestream.models.rope import build_rope, rope_params, yarn_get_mscale

PROJS = ("gate", "up", "down")
EXPERTS = "model.layers.{layer}.mlp.experts."


@dataclass
class DeepseekV3Config:
    raw: dict  # the text model's config (K2.5: text_config with the top level's token ids filled in)
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    moe_layers: list[int]
    eps: float
    vocab_size: int
    tie: bool
    fp8_block: tuple[int, int]  # block-FP8 tile (weight_block_size), used where weight_scale_inv tensors exist
    int4_group: int  # compressed-tensors group size, used where weight_packed tensors exist

    @classmethod
    def from_hf(cls, c: dict) -> "DeepseekV3Config":
        _check_supported(c)
        n, first, freq = c["num_hidden_layers"], c.get("first_k_dense_replace") or 0, c.get("moe_layer_freq") or 1
        experts = c.get("n_routed_experts") or 0
        moe = [i for i in range(n) if experts and i >= first and i % freq == 0]
        quant = c.get("quantization_config") or {}
        return cls(c, c["hidden_size"], c["moe_intermediate_size"], n, experts, c["num_experts_per_tok"],
                   c.get("n_group") or 1, c.get("topk_group") or 1, bool(c.get("norm_topk_prob", True)),
                   float(c.get("routed_scaling_factor", 1.0)), moe, c.get("rms_norm_eps", 1e-6), c["vocab_size"],
                   bool(c.get("tie_word_embeddings", False)), tuple(quant.get("weight_block_size") or FP8_BLOCK),
                   _int4_group(quant))

    @classmethod
    def from_kimi_k25(cls, top: dict) -> "DeepseekV3Config":
        """K2.5 keeps the text model under `text_config`; token ids and quantization may sit at the top."""
        text = dict(top.get("text_config") or {})
        if not text:
            raise UnsupportedModelError("kimi_k25 config.json has no text_config")
        for key in ("eos_token_id", "bos_token_id", "pad_token_id", "quantization_config"):
            if text.get(key) is None and top.get(key) is not None:
                text[key] = top[key]
        return cls.from_hf(text)


def _check_supported(c: dict) -> None:
    """V2-style routers share these field names but not the math; refuse them instead of computing wrong logits."""
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedModelError(f"deepseek_v3 scoring_func {c['scoring_func']!r} is not supported (only sigmoid)")
    if c.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedModelError(f"deepseek_v3 topk_method {c['topk_method']!r} is not supported (only noaux_tc)")
    if c.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"deepseek_v3 hidden_act {c['hidden_act']!r} is not supported (only silu)")


def _int4_group(quant: dict) -> int:
    """group_size of a compressed-tensors config (K2.x: 32); 32 when the config does not say."""
    for group in (quant.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") or {}
        if weights.get("group_size"):
            return int(weights["group_size"])
    return 32


# ---- experts ---------------------------------------------------------------------------------------------------


def expert_layout(cfg: DeepseekV3Config, names: set[str]) -> ExpertLayout:
    first = cfg.moe_layers[0] if cfg.moe_layers else 0
    probe = EXPERTS.format(layer=first)
    if probe + "gate_up_proj" in names:  # the transformers-internal fused layout: [E, 2I, H], gate rows first
        parts = [PartSpec("gate_up", EXPERTS + "gate_up_proj", fused=True),
                 PartSpec("down", EXPERTS + "down_proj", fused=True)]
    else:
        # int4's 8-byte weight_shape rides along (optional) so it is an expert tensor, not a dense one
        suffixes = {"": ("weight",), "fp8": ("weight", "weight_scale_inv"),
                    "int4": ("weight_packed", "weight_scale", "weight_shape")}
        kind = _expert_format(probe + "0.gate_proj.", names)
        parts = [PartSpec(f"{p}.{s}", EXPERTS + "{expert}." + f"{p}_proj.{s}", optional=s == "weight_shape")
                 for p in PROJS for s in suffixes[kind]]
    return ExpertLayout(parts, cfg.num_experts, cfg.top_k, cfg.moe_layers)


def _expert_format(prefix: str, names: set[str]) -> str:
    if prefix + "weight_packed" in names:
        return "int4"
    return "fp8" if prefix + "weight_scale_inv" in names else ""


def expert_fn(cfg: DeepseekV3Config):
    """SiLU-GLU over whichever stored form the expert's tensors have (the parts name it)."""
    plain = expert_glu()
    shapes = {"gate": (cfg.moe_intermediate_size, cfg.hidden_size), "up": (cfg.moe_intermediate_size, cfg.hidden_size),
              "down": (cfg.hidden_size, cfg.moe_intermediate_size)}

    def project(x: torch.Tensor, t: dict[str, torch.Tensor], p: str) -> torch.Tensor:
        if p + ".weight_packed" in t:
            shape = t.get(p + ".weight_shape", shapes[p])  # [out, in]: in may be padded in the packing
            return int4_linear(x, t[p + ".weight_packed"], t[p + ".weight_scale"], cfg.int4_group, shape)
        if p + ".weight_scale_inv" in t:
            return fp8_block_linear(x, t[p + ".weight"], t[p + ".weight_scale_inv"], cfg.fp8_block)
        return linear(x, t[p + ".weight"])

    def fn(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
        if "gate_up" in t:
            return plain(x, t)
        h = torch.nn.functional.silu(project(x, t, "gate")) * project(x, t, "up")
        return project(h, t, "down")

    return fn


# the stored forms' parts: codes and scales of each projection
_QUANT_PARTS = {"fp8": ("weight", "weight_scale_inv"), "int4": ("weight_packed", "weight_scale")}


def _quant_pointers(cfg: DeepseekV3Config, fmt: str, t) -> tuple[int, ...] | None:
    """Addresses of a quantised expert's gate, up and down (codes, scales each), after checking every part's dtype,
    shape and contiguity against the config (the native call reads every expert with one shape, so a malformed one
    would be read out of bounds), else None. Cached on a blob's PartViews (experts.store.cached_addresses)."""
    return cached_addresses(t, fmt, lambda: _checked_pointers(cfg, fmt, t))


def _checked_pointers(cfg: DeepseekV3Config, fmt: str, t) -> tuple[int, ...] | None:
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    codes_name, scale_name = _QUANT_PARTS[fmt]
    got: list[int] = []
    for proj, (rows, cols) in zip(PROJS, ((inter, hidden), (inter, hidden), (hidden, inter))):
        codes, scale = t.get(f"{proj}.{codes_name}"), t.get(f"{proj}.{scale_name}")
        if fmt == "fp8":
            br, bc = cfg.fp8_block
            ok = (codes is not None and codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == (rows, cols)
                  and scale is not None and scale.dtype == torch.float32
                  and tuple(scale.shape) == (-(-rows // br), -(-cols // bc)))
        else:
            shape = t.get(f"{proj}.weight_shape")
            ok = (codes is not None and codes.dtype == torch.int32 and tuple(codes.shape) == (rows, cols // 8)
                  and scale is not None and scale.dtype == torch.bfloat16 and tuple(scale.shape) == (rows, cols // 32)
                  and (shape is None or shape.tolist() == [rows, cols]))
        if not (ok and codes.is_contiguous() and scale.is_contiguous()):
            return None
        got += (codes.data_ptr(), scale.data_ptr())
    return tuple(got)


def expert_group(cfg: DeepseekV3Config):
    """The runner's grouped call for a layer step's resident experts. Block-FP8 (DeepSeek-V3, Kimi K2 Instruct) and
    int4 (Kimi K2 Thinking) experts: each row through its routed experts, every expert of the step in two native
    calls (gate and up of all of them, then down: kernels/_cpu_fp8.c), threads splitting all their rows; an expert
    of at least quant's native row limit goes through its own (chunked) products, and a row's sum over its experts
    is added in the order expert_fn's path adds it. bf16 experts go to glu_group. Declines (the runner then goes
    expert by expert) without the AVX-512 kernels, for widths they do not take, or for parts of other shapes."""
    plain, fn = glu_group(), expert_fn(cfg)
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size

    def run(x, ids, weights, experts, tensors, out, counts: list[int] | None = None) -> bool:
        first = tensors[0]
        fmt = "fp8" if "gate.weight_scale_inv" in first else "int4" if "gate.weight_packed" in first else ""
        if not fmt:
            return plain(x, ids, weights, experts, tensors, out, counts=counts)
        if fmt == "fp8":
            limit = FP8_NATIVE_MAX_T
            fits = hidden % 64 == 0 and inter % 64 == 0 and cfg.fp8_block[1] % 64 == 0
        else:
            limit = INT4_NATIVE_MAX_T
            fits = cfg.int4_group == 32 and hidden % 32 == 0 and inter % 32 == 0
        if not fits or x.requires_grad or not cpu.available() or cpu.simd() != "avx512":
            return False
        ptrs = [_quant_pointers(cfg, fmt, t) for t in tensors]
        if any(p is None for p in ptrs):
            return False
        linear_ptrs = (lambda *e: cpu.linear_fp8_ptrs(*e, cfg.fp8_block)) if fmt == "fp8" else \
            (lambda xs, ts, codes, scales, outs, n, k: cpu.linear_int4_ptrs(xs, ts, codes, scales, True, outs, n, k))

        def native(xr: torch.Tensor, y: torch.Tensor, few: list[tuple[int, int, int]]) -> None:
            gate_up = torch.empty(2, xr.shape[0], inter, dtype=torch.float32)
            xp, gp, upp, yp = xr.data_ptr(), gate_up[0].data_ptr(), gate_up[1].data_ptr(), y.data_ptr()
            a = ([], [], [], [], [])  # gate and up entries: x, tokens, codes, scales, out
            b = ([], [], [], [], [])  # down entries
            for j, start, count in few:
                g, gs, u, us, d, ds = ptrs[j]
                xo, ho = xp + start * hidden * 4, gp + start * inter * 4
                for cols, entry in ((a, (xo, count, g, gs, ho)), (a, (xo, count, u, us, upp + start * inter * 4)),
                                    (b, (ho, count, d, ds, yp + start * hidden * 4))):
                    for col, v in zip(cols, entry):
                        col.append(v)
            linear_ptrs(*a, inter, hidden)
            torch.mul(torch.nn.functional.silu(gate_up[0]), gate_up[1], out=gate_up[0])  # h where down reads it
            linear_ptrs(*b, hidden, inter)

        routed_group(x, ids, weights, experts, tensors, out, limit - 1, native, fn)
        return True

    run.pairs = True  # type: ignore[attr-defined]  # takes the runner's batch-invariant [T, k, D] out
    return run


# ---- dense weights -------------------------------------------------------------------------------------------


class QuantDenseWeights(DenseWeights):
    """DenseWeights that pairs `X.weight` (float8_e4m3fn) with `X.weight_scale_inv` (DeepSeek-V3, Kimi K2), and
    answers `X.weight` with `X.weight_packed` + `X.weight_scale` where a dense weight is int4 pack-quantized. Both
    stay as stored in RAM; blocks.linear multiplies them chunk by chunk (kernels/qweight.py)."""

    def __init__(self, base: DenseWeights, block: tuple[int, int], int4_group: int):
        super().__init__(base.index, base.prefix, base.memory)
        self.block, self.int4_group = block, int4_group

    def __contains__(self, name: str) -> bool:
        return super().__contains__(name) or (name.endswith(".weight") and super().__contains__(name + "_packed"))

    def get(self, name: str) -> torch.Tensor:
        if name.endswith(".weight") and not super().__contains__(name) and super().__contains__(name + "_packed"):
            if name not in self.loaded:
                stem = name[:-len("weight")]
                shape = super().get(stem + "weight_shape") if super().__contains__(stem + "weight_shape") else None
                self.loaded[name] = Int4Weight.wrap(super().get(name + "_packed"), super().get(stem + "weight_scale"),
                                                    self.int4_group, None if shape is None else shape.tolist())
            return self.loaded[name]
        t = super().get(name)
        scale = name + "_scale_inv"
        if t.dtype == torch.float8_e4m3fn and scale in self and not isinstance(t, BlockFp8Weight):
            t = self.loaded[name] = BlockFp8Weight.wrap(t, super().get(scale), self.block)
        return t


# ---- model -----------------------------------------------------------------------------------------------------


def softmax_scale(cfg: DeepseekV3Config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (the reference's yarn_apply_mscale)."""
    c = cfg.raw
    scale = (c.get("qk_nope_head_dim", 128) + c.get("qk_rope_head_dim", 64)) ** -0.5
    p = rope_params(c)
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        m = yarn_get_mscale(float(p["factor"]), float(p["mscale_all_dim"]))
        scale *= m * m
    return scale


def build(cfg: DeepseekV3Config, ctx: ModelContext):
    w = QuantDenseWeights(ctx.weights, cfg.fp8_block, cfg.int4_group)
    rope = build_rope(cfg.raw, cfg.raw.get("qk_rope_head_dim", 64), interleaved=cfg.raw.get("rope_interleave", True))
    opts = MLAOptions.from_hf(cfg.raw, rope=rope, scale=softmax_scale(cfg))
    fn, group = expert_fn(cfg), expert_group(cfg)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        ffn = _moe(cfg, ctx, w, i, fn, group) if i in cfg.moe_layers else dense_glu(w, p + ".mlp")
        layers.append(Layer(MLAMixer(w, p + ".self_attn", opts), ffn, w.get(p + ".input_layernorm.weight"),
                            w.get(p + ".post_attention_layernorm.weight"), cfg.eps))
    ctx = ModelContext(w, ctx.experts, ctx.memory)
    return standard_model(ctx, layers, cfg.eps, cfg.vocab_size, cfg.tie)


def _moe(cfg: DeepseekV3Config, ctx: ModelContext, w: DenseWeights, i: int, fn, group):
    p = f"model.layers.{i}.mlp"
    shared = dense_glu(w, p + ".shared_experts") if f"{p}.shared_experts.gate_proj.weight" in w else None
    return sigmoid_moe(ctx, i, p, fn, cfg.top_k, cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.n_group,
                       cfg.topk_group, shared, group)


# ---- tensor inventory (a directory holding only config.json: `info` and `plan` size it) -----------------------
Inventory = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, safetensors dtype)


def _linear(name: str, rows: int, cols: int, fmt: str, cfg: DeepseekV3Config) -> Inventory:
    """One linear's tensors as the published checkpoints store it: "fp8" (e4m3 codes + float32 scale_inv per tile),
    "int4" (compressed-tensors pack-quantized: int32 words of 8 codes, bf16 group scales, the int32 [out, in]
    shape) or "bf16"."""
    if fmt == "fp8":
        br, bc = cfg.fp8_block
        return {f"{name}.weight": ((rows, cols), "F8_E4M3"),
                f"{name}.weight_scale_inv": ((math.ceil(rows / br), math.ceil(cols / bc)), "F32")}
    if fmt == "int4":
        g = cfg.int4_group
        return {f"{name}.weight_packed": ((rows, math.ceil(cols / 8)), "I32"),
                f"{name}.weight_scale": ((rows, math.ceil(cols / g)), "BF16"),
                f"{name}.weight_shape": ((2,), "I32")}
    return {f"{name}.weight": ((rows, cols), "BF16")}


def _glu(name: str, inter: int, hidden: int, fmt: str, cfg: DeepseekV3Config) -> Inventory:
    """An MLP's (or expert's) gate, up ([inter, hidden]) and down ([hidden, inter]) projections."""
    out: Inventory = {}
    for proj, rows, cols in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
        out.update(_linear(f"{name}.{proj}_proj", rows, cols, fmt, cfg))
    return out


def inventory(cfg: DeepseekV3Config) -> Inventory:
    """Every tensor of a DeepSeek-V3 / Kimi K2 checkpoint from its config: block-FP8 linears where the config says
    `quant_method: fp8` (DeepSeek-V3, Kimi K2 Instruct), int4 routed experts with bf16 dense linears where it says
    compressed-tensors (Kimi K2 Thinking), bf16 otherwise; bf16 embeddings, norms, router and lm_head, the float32
    router correction bias."""
    c, h = cfg.raw, cfg.hidden_size
    quant = c.get("quantization_config") or {}
    dense = "fp8" if quant.get("quant_method") == "fp8" else "bf16"
    experts = "int4" if quant.get("quant_method") == "compressed-tensors" else dense
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    r, q_lora = c["kv_lora_rank"], c.get("q_lora_rank")
    out: Inventory = {"model.embed_tokens.weight": ((cfg.vocab_size, h), "BF16"), "model.norm.weight": ((h,), "BF16")}
    if not cfg.tie:
        out["lm_head.weight"] = ((cfg.vocab_size, h), "BF16")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = ((h,), "BF16")
        out[f"{p}.post_attention_layernorm.weight"] = ((h,), "BF16")
        a = f"{p}.self_attn"
        if q_lora:
            out.update(_linear(f"{a}.q_a_proj", q_lora, h, dense, cfg))
            out[f"{a}.q_a_layernorm.weight"] = ((q_lora,), "BF16")
            out.update(_linear(f"{a}.q_b_proj", heads * (nope + rope), q_lora, dense, cfg))
        else:
            out.update(_linear(f"{a}.q_proj", heads * (nope + rope), h, dense, cfg))
        out.update(_linear(f"{a}.kv_a_proj_with_mqa", r + rope, h, dense, cfg))
        out[f"{a}.kv_a_layernorm.weight"] = ((r,), "BF16")
        out.update(_linear(f"{a}.kv_b_proj", heads * (nope + v), r, dense, cfg))
        out.update(_linear(f"{a}.o_proj", h, heads * v, dense, cfg))
        m = f"{p}.mlp"
        if i not in cfg.moe_layers:
            out.update(_glu(m, c["intermediate_size"], h, dense, cfg))
            continue
        out[f"{m}.gate.weight"] = ((cfg.num_experts, h), "BF16")
        out[f"{m}.gate.e_score_correction_bias"] = ((cfg.num_experts,), "F32")
        shared = (c.get("n_shared_experts") or 0) * cfg.moe_intermediate_size
        if shared:
            out.update(_glu(f"{m}.shared_experts", shared, h, dense, cfg))
        for e in range(cfg.num_experts):
            out.update(_glu(f"{m}.experts.{e}", cfg.moe_intermediate_size, h, experts, cfg))
    return out


FAMILY = Family("deepseek_v3", DeepseekV3Config.from_hf, expert_layout, build, inventory=inventory)
# K2.5 is a multimodal wrapper: same text model, tensors under `language_model.`, vision tower never read.
VARIANTS = {
    "kimi_k2": Family("kimi_k2", DeepseekV3Config.from_hf, expert_layout, build, inventory=inventory),
    "kimi_k25": Family("kimi_k25", DeepseekV3Config.from_kimi_k25, expert_layout, build, prefix="language_model.",
                       ignore=("vision_tower.", "mm_projector.", "multi_modal_projector."),
                       inventory=lambda cfg: {"language_model." + k: v for k, v in inventory(cfg).items()}),
}
