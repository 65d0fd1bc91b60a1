"""Kimi K3 (`kimi_k3`, text part): config, official tensor inventory, expert layout and model assembly.

The checkpoint is multimodal: the text model sits under `text_config` and `language_model.`; vision tensors are
never read. AttnRes and the K3 decoder live in attnres.py, the latent MoE in latent_moe.py, the KDA and MLA
mixers in kda.py / mla.py. `k3_sizes_from_config` gives exact sizes from config.json alone (no shards).
"""
from __future__ import annotations

from dataclasses import dataclass

from moestream.errors import UnsupportedModelError
from moestream.experts.store import PartSpec
from moestream.models.attnres import K3Layer, K3Model, fold_query, seals_at
from moestream.models.base import ExpertLayout, Family, ModelContext, dense_glu
from moestream.models.kda import KDAMixer, KDAOptions
from moestream.models.latent_moe import LatentMoE, make_act
from moestream.models.mla import MLAMixer, MLAOptions

PREFIX = "language_model."
VISION = ("vision_tower.", "mm_projector.")
EXPERT = "model.layers.{layer}.block_sparse_moe.experts.{expert}."
MXFP4_GROUP = 32
# Expert part names in checkpoint order (w1, w2, w3; packed before scale) so one expert is one read.
MXFP4_PARTS = [(f"{w}_{kind}", f"{w}.weight_{kind}") for w in ("w1", "w2", "w3") for kind in ("packed", "scale")]


@dataclass
class KimiK3Config:
    raw: dict  # text_config (with the top level's token ids filled in)
    hidden_size: int
    num_layers: int
    vocab_size: int
    eps: float
    block: int  # attn_res_block_size
    first_dense: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_shared: int
    latent: int  # routed_expert_hidden_size
    latent_norm: bool
    scaling: float
    situ_beta: float
    situ_linear_beta: float
    mla_layers: list[int]  # 0-based
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    kda_heads: int
    kda_dim: int
    conv_size: int
    gate_lower_bound: float
    quantized: bool  # routed experts are compressed-tensors MXFP4

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.first_dense, self.num_layers))

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in set(self.mla_layers)]

    @property
    def a_log_len(self) -> int:
        """A_log is stored zero-padded (128 entries for 96 heads on K3): padded to the head dim."""
        return max(self.kda_heads, self.kda_dim)

    @classmethod
    def from_hf(cls, top: dict) -> "KimiK3Config":
        c = dict(top.get("text_config", top))
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if c.get(key) is None and top.get(key) is not None:
                c[key] = top[key]
        _check_supported(c)
        lac = c["linear_attn_config"]
        n = c["num_hidden_layers"]
        mla = sorted(i - 1 for i in lac["full_attn_layers"])  # the checkpoint writes these 1-based
        if any(i < 0 or i >= n for i in mla):
            raise UnsupportedModelError(f"kimi_k3: full_attn_layers {lac['full_attn_layers']} outside 1..{n}")
        return cls(
            c, c["hidden_size"], n, c["vocab_size"], c.get("rms_norm_eps", 1e-5), c["attn_res_block_size"],
            c.get("first_k_dense_replace", 1), c["intermediate_size"], c["moe_intermediate_size"],
            c["num_experts"], c["num_experts_per_token"], c.get("num_shared_experts", 0),
            c["routed_expert_hidden_size"], bool(c.get("latent_moe_use_norm", True)),
            float(c.get("routed_scaling_factor", 1.0)), float(c.get("activation_situ_beta", 4.0)),
            float(c.get("activation_situ_linear_beta", 25.0)), mla, c["num_attention_heads"], c["q_lora_rank"],
            c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], lac["num_heads"],
            lac["head_dim"], lac.get("short_conv_kernel_size", 4), float(lac.get("gate_lower_bound", -5.0)),
            _is_mxfp4(top.get("quantization_config") or c.get("quantization_config")),
        )


def _check_supported(c: dict) -> None:
    problems = []
    if c.get("hidden_act", "situ") != "situ":
        problems.append(f"hidden_act {c.get('hidden_act')!r} (expected 'situ')")
    if c.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        problems.append(f"moe_router_activation_func {c.get('moe_router_activation_func')!r}")
    if (c.get("num_expert_group") or 1) != 1:
        problems.append(f"num_expert_group {c.get('num_expert_group')} (K3 uses one group)")
    if not c.get("mla_use_nope", True) or c.get("rope_scaling") or "rope_theta" in c:
        problems.append("MLA with rope (K3 is NoPE)")
    if not c.get("moe_renormalize", True):
        problems.append("moe_renormalize false")
    if c.get("num_nextn_predict_layers"):
        problems.append("MTP layers")
    if problems:
        raise UnsupportedModelError("kimi_k3: unsupported config: " + "; ".join(problems))


def _is_mxfp4(q: dict | None) -> bool:
    if not q:
        return False
    fmt = q.get("format") or next((g.get("format") for g in (q.get("config_groups") or {}).values()), None)
    if q.get("quant_method") != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise UnsupportedModelError(
            f"kimi_k3: quantization {q.get('quant_method')!r} / {fmt!r} is not supported "
            "(expected compressed-tensors mxfp4-pack-quantized)")
    return True


# ---- tensor inventory ----------------------------------------------------------------------------------
Inventory = dict[str, tuple[tuple[int, ...], str]]  # name (no prefix) -> (shape, safetensors dtype)


def expert_tensors(cfg: KimiK3Config, layer: int, e: int) -> Inventory:
    """One routed expert's tensors: w1 = gate, w3 = up ([I, latent]), w2 = down ([latent, I])."""
    p = EXPERT.format(layer=layer, expert=e)
    shapes = {"w1": (cfg.moe_intermediate_size, cfg.latent), "w2": (cfg.latent, cfg.moe_intermediate_size),
              "w3": (cfg.moe_intermediate_size, cfg.latent)}
    out: Inventory = {}
    for w, (rows, cols) in shapes.items():
        if cfg.quantized:
            out[f"{p}{w}.weight_packed"] = ((rows, cols // 2), "U8")  # two E2M1 codes per byte
            out[f"{p}{w}.weight_scale"] = ((rows, cols // MXFP4_GROUP), "U8")  # one E8M0 per 32 inputs
        else:
            out[f"{p}{w}.weight"] = ((rows, cols), "BF16")
    return out


def _mixer_tensors(cfg: KimiK3Config, layer: int) -> Inventory:
    p, h = f"model.layers.{layer}.self_attn.", cfg.hidden_size
    if layer in cfg.mla_layers:
        qk, r = cfg.nope_dim + cfg.rope_dim, cfg.kv_lora_rank
        return {p + "q_a_proj.weight": ((cfg.q_lora_rank, h), "BF16"),
                p + "q_a_layernorm.weight": ((cfg.q_lora_rank,), "BF16"),
                p + "q_b_proj.weight": ((cfg.heads * qk, cfg.q_lora_rank), "BF16"),
                p + "kv_a_proj_with_mqa.weight": ((r + cfg.rope_dim, h), "BF16"),
                p + "kv_a_layernorm.weight": ((r,), "BF16"),
                p + "kv_b_proj.weight": ((cfg.heads * (cfg.nope_dim + cfg.v_dim), r), "BF16"),
                p + "g_proj.weight": ((cfg.heads * cfg.v_dim, h), "BF16"),
                p + "o_proj.weight": ((h, cfg.heads * cfg.v_dim), "BF16")}
    wide, d = cfg.kda_heads * cfg.kda_dim, cfg.kda_dim
    out: Inventory = {p + f"{n}_proj.weight": ((wide, h), "BF16") for n in "qkv"}
    out.update({p + f"{n}_conv1d.weight": ((wide, 1, cfg.conv_size), "F32") for n in "qkv"})
    out.update({p + "f_a_proj.weight": ((d, h), "BF16"), p + "f_b_proj.weight": ((wide, d), "BF16"),
                p + "A_log": ((cfg.a_log_len,), "F32"), p + "dt_bias": ((wide,), "F32"),
                p + "b_proj.weight": ((cfg.kda_heads, h), "BF16"), p + "g_proj.weight": ((wide, h), "BF16"),
                p + "o_norm.weight": ((d,), "F32"), p + "o_proj.weight": ((h, wide), "BF16")})
    return out


def _ffn_tensors(cfg: KimiK3Config, layer: int) -> Inventory:
    h = cfg.hidden_size
    if layer < cfg.first_dense:
        p, i = f"model.layers.{layer}.mlp.", cfg.intermediate_size
        return {p + "gate_proj.weight": ((i, h), "BF16"), p + "up_proj.weight": ((i, h), "BF16"),
                p + "down_proj.weight": ((h, i), "BF16")}
    p, s, lat = f"model.layers.{layer}.block_sparse_moe.", cfg.num_shared * cfg.moe_intermediate_size, cfg.latent
    out: Inventory = {p + "gate.weight": ((cfg.num_experts, h), "BF16"),
                      p + "gate.e_score_correction_bias": ((cfg.num_experts,), "F32"),
                      p + "routed_expert_down_proj.weight": ((lat, h), "BF16"),
                      p + "routed_expert_up_proj.weight": ((h, lat), "BF16")}
    if cfg.latent_norm:
        out[p + "routed_expert_norm.weight"] = ((lat,), "BF16")
    if s:
        out.update({p + "shared_experts.gate_proj.weight": ((s, h), "BF16"),
                    p + "shared_experts.up_proj.weight": ((s, h), "BF16"),
                    p + "shared_experts.down_proj.weight": ((h, s), "BF16")})
    return out


def layer_dense_tensors(cfg: KimiK3Config, layer: int) -> Inventory:
    """Every non-expert tensor of one decoder layer."""
    p, h = f"model.layers.{layer}.", cfg.hidden_size
    out: Inventory = {p + n + ".weight": ((h,), "BF16") for n in
                      ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm")}
    out.update({p + n + ".weight": ((1, h), "BF16") for n in ("self_attention_res_proj", "mlp_res_proj")})
    out.update(_mixer_tensors(cfg, layer))
    out.update(_ffn_tensors(cfg, layer))
    return out


def top_tensors(cfg: KimiK3Config) -> Inventory:
    h, v = cfg.hidden_size, cfg.vocab_size
    return {"model.embed_tokens.weight": ((v, h), "BF16"), "model.norm.weight": ((h,), "BF16"),
            "model.output_attn_res_norm.weight": ((h,), "BF16"),
            "model.output_attn_res_proj.weight": ((1, h), "BF16"), "lm_head.weight": ((v, h), "BF16")}


_ITEMSIZE = {"BF16": 2, "F32": 4, "U8": 1}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _inventory_totals(inv: Inventory) -> tuple[int, int]:
    """(parameters, bytes); an MXFP4 packed byte holds two parameters, scales are not parameters."""
    params = nbytes = 0
    for name, (shape, dtype) in inv.items():
        n = _numel(shape)
        nbytes += n * _ITEMSIZE[dtype]
        params += 2 * n if name.endswith(".weight_packed") else 0 if name.endswith(".weight_scale") else n
    return params, nbytes


def inventory(cfg: KimiK3Config) -> Inventory:
    """Every text-model tensor of the checkpoint, with the `language_model.` prefix (vision tower excluded)."""
    out: Inventory = dict(top_tensors(cfg))
    for layer in range(cfg.num_layers):
        out.update(layer_dense_tensors(cfg, layer))
        if layer in cfg.moe_layers:
            for e in range(cfg.num_experts):
                out.update(expert_tensors(cfg, layer, e))
    return {PREFIX + name: v for name, v in out.items()}


def k3_sizes_from_config(cfg: dict) -> dict:
    """Exact sizes of a K3 checkpoint from its config.json alone (top-level or text_config dict).

    Walks the full tensor inventory (spec section 3); all experts are alike. Active parameters are those a token
    is multiplied through: dense ones minus the embedding table (a row lookup), plus top_k experts per MoE layer.
    """
    c = KimiK3Config.from_hf(cfg)
    dense: Inventory = dict(top_tensors(c))
    for layer in range(c.num_layers):
        dense.update(layer_dense_tensors(c, layer))
    dense_params, dense_bytes = _inventory_totals(dense)
    n_moe = len(c.moe_layers)
    e_params, e_bytes = _inventory_totals(expert_tensors(c, c.moe_layers[0], 0)) if n_moe else (0, 0)
    n_experts = n_moe * c.num_experts
    return {
        "model_type": "kimi_k3",
        "num_layers": c.num_layers, "mla_layers": len(c.mla_layers), "kda_layers": len(c.kda_layers),
        "moe_layers": n_moe, "num_experts": c.num_experts, "top_k": c.top_k,
        "num_tensors": len(dense) + n_experts * (6 if c.quantized else 3),
        "params": dense_params + n_experts * e_params,
        "active_params": dense_params - c.vocab_size * c.hidden_size + n_moe * c.top_k * e_params,
        "embedding_params": c.vocab_size * c.hidden_size,  # excluded from active_params (a row lookup)
        "dense_params": dense_params, "dense_bytes": dense_bytes,
        "expert_params": n_experts * e_params, "expert_bytes": n_experts * e_bytes,
        "bytes_per_expert": e_bytes, "total_bytes": dense_bytes + n_experts * e_bytes,
        "cold_expert_bytes_per_token": n_moe * c.top_k * e_bytes,
        "expert_format": "mxfp4" if c.quantized else "bf16",
    }


# ---- engine hooks --------------------------------------------------------------------------------------
def expert_layout(cfg: KimiK3Config, names: set[str]) -> ExpertLayout:
    first = cfg.moe_layers[0] if cfg.moe_layers else 0
    packed = EXPERT.format(layer=first, expert=0) + "w1.weight_packed" in names
    if cfg.moe_layers and cfg.quantized != packed:
        raise UnsupportedModelError(
            "kimi_k3: quantization_config and the expert tensors disagree: " + (
                "MXFP4 is declared but experts have no weight_packed" if cfg.quantized
                else "experts are packed (weight_packed) but there is no compressed-tensors quantization_config"))
    if packed:
        parts = [PartSpec(name, EXPERT + suffix) for name, suffix in MXFP4_PARTS]
    else:
        parts = [PartSpec(w, EXPERT + w + ".weight") for w in ("w1", "w2", "w3")]
    return ExpertLayout(parts, cfg.num_experts, cfg.top_k, cfg.moe_layers)


def build(cfg: KimiK3Config, ctx: ModelContext) -> K3Model:
    w = ctx.weights
    kda = KDAOptions.from_hf(cfg.raw, decay="lower_bound_sigmoid", gate_lower_bound=cfg.gate_lower_bound)
    mla = MLAOptions.from_hf(cfg.raw, rope=None, output_gate=bool(cfg.raw.get("mla_use_output_gate", True)),
                             latent_eps=1e-6)  # upstream builds the latent norms with 1e-6 (spec 2.3)
    act = make_act(cfg.situ_beta, cfg.situ_linear_beta)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        mixer = MLAMixer(w, p + ".self_attn", mla) if i in cfg.mla_layers else KDAMixer(w, p + ".self_attn", kda)
        layers.append(K3Layer(
            mixer, _ffn(cfg, ctx, i, act), w.get(p + ".input_layernorm.weight"),
            w.get(p + ".post_attention_layernorm.weight"),
            fold_query(w.get(p + ".self_attention_res_norm.weight"), w.get(p + ".self_attention_res_proj.weight")),
            fold_query(w.get(p + ".mlp_res_norm.weight"), w.get(p + ".mlp_res_proj.weight")),
            seals_at(i, cfg.block), cfg.eps))
    out_query = fold_query(w.get("model.output_attn_res_norm.weight"), w.get("model.output_attn_res_proj.weight"))
    ctx.memory.add_dense((2 * len(layers) + 1) * out_query.numel() * 4)  # the folded fp32 queries stay resident
    return K3Model(w.get("model.embed_tokens.weight"), layers, w.get("model.norm.weight"), w.get("lm_head.weight"),
                   cfg.eps, cfg.vocab_size, ctx.memory, out_query=out_query, block=cfg.block)


def _ffn(cfg: KimiK3Config, ctx: ModelContext, layer: int, act):
    if layer >= cfg.first_dense:
        return LatentMoE(ctx, layer, cfg.top_k, cfg.scaling, cfg.latent_norm, cfg.eps, act, cfg.quantized)
    return dense_glu(ctx.weights, f"model.layers.{layer}.mlp", act)


FAMILY = Family("kimi_k3", KimiK3Config.from_hf, expert_layout, build, prefix=PREFIX, ignore=VISION,
                inventory=inventory)
