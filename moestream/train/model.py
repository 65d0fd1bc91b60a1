"""A trainable Kimi K3 text model in plain PyTorch (spec/kimi-k3.md at small scale), for the built-in demo model.

Owns the demo architecture's config and its autograd-friendly modules: AttnRes, KDA and gated NoPE MLA mixers,
the latent MoE with a sigmoid router whose correction bias is steered by routing counts, SiTU-GLU. Parameter
names are the checkpoint's (without `language_model.`) except the routed experts, which train stacked
[E, out, in] and are split per expert at export. Independent of moestream.models (the inference engine).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from moestream.errors import MoestreamError
from moestream.train.kda import chunked_delta


@dataclass
class DemoConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 8
    intermediate_size: int = 768  # layer 0's dense MLP
    num_experts: int = 64
    top_k: int = 4
    moe_intermediate_size: int = 128
    latent_size: int = 128  # routed_expert_hidden_size
    num_shared_experts: int = 2
    attn_res_block_size: int = 2
    kda_heads: int = 4
    kda_head_dim: int = 64
    conv_kernel: int = 4
    mla_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rms_norm_eps: float = 1e-5
    latent_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm
    gate_lower_bound: float = -5.0
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scaling_factor: float = 1.0
    kda_chunk: int = 16

    def validate(self) -> "DemoConfig":
        if self.num_layers < 3:
            raise MoestreamError("the demo architecture needs at least 3 layers (dense layer 0, two final MLA)")
        if self.top_k > self.num_experts or self.top_k < 1:
            raise MoestreamError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.kda_heads > self.kda_head_dim:
            raise MoestreamError("A_log is stored [kda_head_dim] like K3's checkpoint: needs kda_heads <= head_dim")
        if self.kda_chunk > 16:
            raise MoestreamError("kda_chunk above 16 can overflow fp32 with a -5 decay bound")
        return self

    @property
    def mla_layers(self) -> list[int]:
        """0-based MLA layers: every fourth (3, 7, ...) plus the last two, as in K3."""
        n = self.num_layers
        return sorted({i for i in range(3, n, 4)} | {n - 2, n - 1})

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layers

    def to_dict(self) -> dict:
        return asdict(self)


# ---- shared pieces ----------------------------------------------------------------------------------------------
class Weight(nn.Module):
    """A bare `.weight` parameter so state-dict names match the checkpoint's (`...norm.weight`)."""

    def __init__(self, *shape: int, fill: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, fill))


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def situ(a: torch.Tensor, u: torch.Tensor, beta: float, lin: float) -> torch.Tensor:
    return (beta * torch.tanh(a / beta) * torch.sigmoid(a)) * (lin * torch.tanh(u / lin))


def lin(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class GLU(nn.Module):
    """SiTU-GLU MLP with HF names gate_proj / up_proj / down_proj (dense layer 0, shared experts)."""

    def __init__(self, cfg: DemoConfig, hidden: int, width: int):
        super().__init__()
        self.cfg = cfg
        self.gate_proj, self.up_proj, self.down_proj = lin(hidden, width), lin(hidden, width), lin(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), c.situ_beta, c.situ_linear_beta))


def attn_res_read(cands: list[torch.Tensor], norm: torch.Tensor, proj: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax-weighted sum of raw candidates, scored by RMS-normalised keys against the folded query."""
    v = torch.stack(cands)  # [S, B, T, H]
    score = (rms(v, None, eps) * (norm * proj[0])).sum(-1)  # [S, B, T]
    return (score.softmax(0).unsqueeze(-1) * v).sum(0)


# ---- mixers -----------------------------------------------------------------------------------------------------
class KDA(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        h, n, d = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim
        self.cfg = cfg
        self.q_proj, self.k_proj, self.v_proj, self.g_proj = (lin(h, n * d) for _ in range(4))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(n * d, n * d, cfg.conv_kernel, groups=n * d, bias=False) for _ in range(3))
        self.f_a_proj, self.f_b_proj = lin(h, d), lin(d, n * d)
        self.b_proj = lin(h, n)
        self.o_norm = Weight(d)
        self.o_proj = lin(n * d, h)
        self.A_log = nn.Parameter(torch.zeros(d))  # K3 stores [head_dim]; only the first n entries are used
        self.dt_bias = nn.Parameter(torch.zeros(n * d))

    def conv(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv then SiLU; the last tap multiplies the current token."""
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.cfg.conv_kernel - 1, 0)), conv.weight, groups=x.shape[-1])
        return F.silu(y.transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, (b, t, _) = self.cfg, x.shape
        n, d = c.kda_heads, c.kda_head_dim
        q = self.conv(self.q_conv1d, self.q_proj(x)).view(b, t, n, d)
        k = self.conv(self.k_conv1d, self.k_proj(x)).view(b, t, n, d)
        v = self.conv(self.v_conv1d, self.v_proj(x)).view(b, t, n, d)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        f = self.f_b_proj(self.f_a_proj(x)).view(b, t, n, d)
        rate = self.A_log[:n].exp().view(n, 1)
        g = c.gate_lower_bound * torch.sigmoid(rate * (f + self.dt_bias.view(n, d)))  # log-decay in (-5, 0)
        beta = torch.sigmoid(self.b_proj(x))  # [B, T, n]
        o = chunked_delta(q, k, v, g, beta, c.kda_chunk)  # [B, T, n, d]
        o = rms(o, self.o_norm.weight, c.rms_norm_eps) * torch.sigmoid(self.g_proj(x).view(b, t, n, d))
        return self.o_proj(o.reshape(b, t, n * d))


class MLA(nn.Module):
    """Gated NoPE MLA: the 'rope' columns take part in the score but nothing is rotated."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        h, n = cfg.hidden_size, cfg.mla_heads
        self.cfg = cfg
        dq = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.q_a_proj, self.q_a_layernorm = lin(h, cfg.q_lora_rank), Weight(cfg.q_lora_rank)
        self.q_b_proj = lin(cfg.q_lora_rank, n * dq)
        self.kv_a_proj_with_mqa = lin(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_a_layernorm = Weight(cfg.kv_lora_rank)
        self.kv_b_proj = lin(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.g_proj = lin(h, n * cfg.v_head_dim)
        self.o_proj = lin(n * cfg.v_head_dim, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, (b, t, _) = self.cfg, x.shape
        n, dn, dr, dv = c.mla_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = self.q_b_proj(rms(self.q_a_proj(x), self.q_a_layernorm.weight, c.latent_eps)).view(b, t, n, dn + dr)
        lat, k_r = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, dr], dim=-1)
        kv = self.kv_b_proj(rms(lat, self.kv_a_layernorm.weight, c.latent_eps)).view(b, t, n, dn + dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        k = torch.cat([k_nope, k_r.unsqueeze(2).expand(b, t, n, dr)], dim=-1)  # k_r shared by all heads
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=(dn + dr) ** -0.5)  # [B, n, T, dv]
        o = o.transpose(1, 2).reshape(b, t, n * dv) * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


# ---- latent MoE -------------------------------------------------------------------------------------------------
class Gate(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))


class Experts(nn.Module):
    """All routed experts of a layer stacked on dim 0 (w1 = gate, w3 = up: [E, I, L]; w2 = down: [E, L, I])."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        e, i, lat = cfg.num_experts, cfg.moe_intermediate_size, cfg.latent_size
        self.w1, self.w3 = nn.Parameter(torch.empty(e, i, lat)), nn.Parameter(torch.empty(e, i, lat))
        self.w2 = nn.Parameter(torch.empty(e, lat, i))


class LatentMoE(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.experts = Experts(cfg)
        self.routed_expert_down_proj = lin(cfg.hidden_size, cfg.latent_size)
        self.routed_expert_norm = Weight(cfg.latent_size)
        self.routed_expert_up_proj = lin(cfg.latent_size, cfg.hidden_size)
        self.shared_experts = GLU(cfg, cfg.hidden_size, cfg.num_shared_experts * cfg.moe_intermediate_size)
        self.register_buffer("counts", torch.zeros(cfg.num_experts), persistent=False)  # since last bias update

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (ids, weights) [N, k]: the bias picks, the unbiased sigmoid scores weigh."""
        s = torch.sigmoid(F.linear(x, self.gate.weight))  # [N, E]
        ids = torch.topk(s.detach() + self.gate.e_score_correction_bias, self.cfg.top_k, dim=-1).indices
        w = s.gather(1, ids)
        return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * self.cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, w = self.route(x)
        self.counts += torch.bincount(ids.flatten(), minlength=self.cfg.num_experts).float()
        y = rms(self.run_experts(self.routed_expert_down_proj(x), ids, w), self.routed_expert_norm.weight,
                self.cfg.rms_norm_eps)
        return (self.routed_expert_up_proj(y) + self.shared_experts(x)).view(shape)

    def run_experts(self, z: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Experts as one padded batched matmul: slots sorted by expert into [E, cap, L]."""
        c, k = self.cfg, ids.shape[1]
        eid = ids.flatten()
        order = torch.argsort(eid, stable=True)
        e_sorted = eid[order]
        counts = torch.bincount(eid, minlength=c.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(eid.numel()) - starts[e_sorted]  # slot index inside its expert's rows
        tok = order // k
        buf = z.new_zeros(c.num_experts, int(counts.max()), z.shape[-1])
        buf = buf.index_put((e_sorted, pos), z[tok])  # [E, cap, L]
        e = self.experts
        h = situ(buf @ e.w1.transpose(1, 2), buf @ e.w3.transpose(1, 2), c.situ_beta, c.situ_linear_beta)
        y = (h @ e.w2.transpose(1, 2))[e_sorted, pos]  # [N*k, L]
        y = y * w.flatten()[order].unsqueeze(-1)
        return z.new_zeros(z.shape).index_add(0, tok, y)


# ---- decoder ----------------------------------------------------------------------------------------------------
class DecoderLayer(nn.Module):
    def __init__(self, cfg: DemoConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        h = cfg.hidden_size
        self.self_attn = MLA(cfg) if cfg.is_mla(index) else KDA(cfg)
        if index == 0:
            self.mlp = GLU(cfg, h, cfg.intermediate_size)
        else:
            self.block_sparse_moe = LatentMoE(cfg)
        self.input_layernorm, self.post_attention_layernorm = Weight(h), Weight(h)
        self.self_attention_res_norm, self.self_attention_res_proj = Weight(h), Weight(1, h, fill=0.0)
        self.mlp_res_norm, self.mlp_res_proj = Weight(h), Weight(1, h, fill=0.0)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) if self.index == 0 else self.block_sparse_moe(x)

    def forward(self, p: torch.Tensor | None, sealed: list[torch.Tensor]):
        eps = self.cfg.rms_norm_eps
        a = attn_res_read(sealed + [p], self.self_attention_res_norm.weight, self.self_attention_res_proj.weight,
                          eps) if sealed else p
        if self.index % self.cfg.attn_res_block_size == 0:  # seal after the read
            sealed, p = sealed + [p], None
        u = self.self_attn(rms(a, self.input_layernorm.weight, eps))
        p = u if p is None else p + u
        b = attn_res_read(sealed + [p], self.mlp_res_norm.weight, self.mlp_res_proj.weight, eps)
        return p + self.ffn(rms(b, self.post_attention_layernorm.weight, eps)), sealed


class Backbone(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = Weight(cfg.hidden_size)
        self.output_attn_res_norm = Weight(cfg.hidden_size)
        self.output_attn_res_proj = Weight(1, cfg.hidden_size, fill=0.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        p, sealed = self.embed_tokens(tokens), []
        for layer in self.layers:
            p, sealed = layer(p, sealed)
        eps = self.cfg.rms_norm_eps
        h = attn_res_read(sealed + [p], self.output_attn_res_norm.weight, self.output_attn_res_proj.weight, eps)
        return rms(h, self.norm.weight, eps)


class DemoK3(nn.Module):
    """K3 text model for training; `forward(tokens [B, T]) -> logits [B, T, V]`."""

    def __init__(self, cfg: DemoConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg.validate()
        self.model = Backbone(cfg)
        self.lm_head = lin(cfg.hidden_size, cfg.vocab_size)
        init_weights(self, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))

    def moe_layers(self) -> list[LatentMoE]:
        return [m for m in self.modules() if isinstance(m, LatentMoE)]

    @torch.no_grad()
    def update_bias(self, rate: float) -> list[torch.Tensor]:
        """Aux-loss-free balancing: raise the bias of under-used experts, lower over-used ones; returns the counts."""
        out = []
        for moe in self.moe_layers():
            counts = moe.counts.clone()
            if counts.sum() > 0:
                moe.gate.e_score_correction_bias += rate * torch.sign(counts.mean() - counts)
            moe.counts.zero_()
            out.append(counts)
        return out


RESIDUAL_OUT = ("o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight",
                "routed_expert_up_proj.weight")
UNIT_INIT = ("norm.weight", "layernorm.weight", "res_proj.weight", "A_log", "dt_bias")


@torch.no_grad()
def init_weights(model: DemoK3, seed: int) -> None:
    """Normal(0.02) matrices, residual outputs scaled down by depth, KDA decays spread over slow..fast."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    for name, p in model.named_parameters():
        if name.endswith(UNIT_INIT):  # set by the constructors (ones, zeros)
            continue
        std = 0.02 / math.sqrt(2 * cfg.num_layers) if name.endswith(RESIDUAL_OUT) else 0.02
        if "conv1d" in name:
            std = 0.5 / math.sqrt(cfg.conv_kernel)
        p.copy_(torch.randn(p.shape, generator=g) * std)
    for m in model.modules():
        if isinstance(m, KDA):  # per-step decay rates log-uniform in [1e-3, 0.5]: some channels remember long
            n, d = cfg.kda_heads, cfg.kda_head_dim
            rate = torch.exp(torch.empty(n * d).uniform_(math.log(1e-3), math.log(0.5), generator=g))
            frac = rate / -cfg.gate_lower_bound
            m.dt_bias.copy_(torch.log(frac / (1 - frac)))
