"""Kimi Delta Attention (KDA): the linear-attention mixer of Kimi Linear and Kimi K3.

Owns the KDA block (q/k/v projections, short causal depthwise convs, per-channel decay, beta, delta-rule state,
gated output norm), its two decay variants (Kimi Linear's softplus, K3's lower-bounded sigmoid) and two output
gates (low-rank, full-rank), the chunked prefill form and the token recurrence, and the per-sequence state
(conv windows and the fp32 [H, dk, dv] matrix). Softmax attention (MLA) lives in mla.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moestream.memory.state import Batch, SeqState, scratch, scratch_budget
from moestream.errors import CheckpointError, UnsupportedModelError
from moestream.kernels import cpu
from moestream.kernels.qweight import matrix_shape
from moestream.models.blocks import linear, rms_norm

DECAYS = ("softplus", "lower_bound_sigmoid")
GATES = ("low_rank", "full_rank")
CHUNK_SCRATCH = 32 << 20  # bytes of chunk scratch per head group without a budget (with one: the scratch allowance)


@dataclass
class KDAOptions:
    heads: int
    head_dim: int
    conv_kernel: int = 4
    decay: str = "softplus"  # Kimi Linear: g = -exp(A_log) softplus(f + dt_bias); K3: "lower_bound_sigmoid"
    gate_lower_bound: float = -5.0  # K3: g = lb * sigmoid(exp(A_log) (f + dt_bias))
    output_gate: str = "low_rank"  # Kimi Linear: g_b(g_a x); K3: "full_rank" g_proj x
    eps: float = 1e-5  # o_norm eps (the model's rms_norm_eps)
    l2_eps: float = 1e-6  # q/k normalisation: z / sqrt(sum z^2 + eps)
    chunk: int = 64

    @classmethod
    def from_hf(cls, c: dict, **overrides) -> "KDAOptions":
        """From `linear_attn_config` (checkpoint names), else transformers' flat linear_* fields."""
        lac = c.get("linear_attn_config") or {}
        lb = lac.get("gate_lower_bound")
        opts = cls(heads=lac.get("num_heads", c.get("linear_num_heads", 32)),
                   head_dim=lac.get("head_dim", c.get("linear_head_dim", 128)),
                   conv_kernel=lac.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", 4)),
                   decay="softplus" if lb is None else "lower_bound_sigmoid",
                   gate_lower_bound=-5.0 if lb is None else float(lb),
                   output_gate="full_rank" if lac.get("use_full_rank_gate") else "low_rank",
                   eps=c.get("rms_norm_eps", 1e-5))
        for k, v in overrides.items():
            setattr(opts, k, v)
        return opts


class KDAState:
    """One sequence's KDA state for one layer: raw q/k/v inputs of the last kernel-1 tokens and the matrix S."""

    def __init__(self, opt: KDAOptions, seq: SeqState):
        width = opt.heads * opt.head_dim
        self.conv = torch.zeros(3, opt.conv_kernel - 1, width)  # [q|k|v, K-1, C]
        self.S = torch.zeros(opt.heads, opt.head_dim, opt.head_dim)  # [H, dk, dv] fp32
        seq.account_fixed((self.conv.numel() + self.S.numel()) * 4, "KDA recurrent state")


class KDAMixer:
    """A KDA block built from HF tensor names under `prefix` (e.g. model.layers.0.self_attn)."""

    def __init__(self, w, prefix: str, opt: KDAOptions):
        if opt.decay not in DECAYS or opt.output_gate not in GATES:
            raise UnsupportedModelError(f"KDA decay {opt.decay!r} / output gate {opt.output_gate!r} not supported")
        p, self.opt = prefix, opt
        self.proj = [w.get(f"{p}.{n}_proj.weight") for n in "qkv"]
        self.conv = [w.get(f"{p}.{n}_conv1d.weight") for n in "qkv"]  # [C, 1, K] each
        width = opt.heads * opt.head_dim
        for n, proj, conv in zip("qkv", self.proj, self.conv):
            shape = matrix_shape(proj)  # (a b12-coded projection's stored bytes have another shape)
            if len(shape) != 2 or shape[0] != width or tuple(conv.shape) != (width, 1, opt.conv_kernel):
                raise CheckpointError(f"{p}.{n}_proj / {n}_conv1d have shapes {list(shape)} / "
                                      f"{list(conv.shape)}: config.json's KDA heads x head_dim is {width} and its "
                                      f"conv kernel {opt.conv_kernel}")
        self.f_a, self.f_b = w.get(f"{p}.f_a_proj.weight"), w.get(f"{p}.f_b_proj.weight")
        # A_log: [1, 1, H, 1] in Kimi Linear, [128] in K3 whose tail past num_heads is padding
        self.A_log = w.get(f"{p}.A_log").reshape(-1)[: opt.heads]
        self.dt_bias = w.get(f"{p}.dt_bias").view(opt.heads, opt.head_dim)
        self.b_proj = w.get(f"{p}.b_proj.weight")
        if opt.output_gate == "low_rank":
            self.gate = (w.get(f"{p}.g_a_proj.weight"), w.get(f"{p}.g_b_proj.weight"))
        else:
            self.gate = (w.get(f"{p}.g_proj.weight"),)
        self.o_norm, self.o_proj = w.get(f"{p}.o_norm.weight"), w.get(f"{p}.o_proj.weight")
        self.memory = w.memory

    def __call__(self, x: torch.Tensor, batch: Batch, index: int) -> torch.Tensor:
        o = self.opt
        t = x.shape[0]
        raw = [linear(x, wt) for wt in self.proj]  # 3 x [T, C], before the conv
        g = self.decay(x)  # [T, H, dk] log-decay per step, <= 0
        beta = torch.sigmoid(linear(x, self.b_proj))  # [T, H]
        out = torch.empty(t, o.heads, o.head_dim)
        decoding = [seg for seg in batch.segments if seg.length == 1]
        batched = len(decoding) > 1 or (len(decoding) == 1 and cpu.available())
        if batched:  # sequences with one token each: one batched recurrence step (native: states in place)
            self._decode_batch(decoding, raw, g, beta, out, index)
        for seg in batch.segments:
            if batched and seg.length == 1:
                continue
            st = seg.state.slot(index, lambda s=seg.state: KDAState(o, s))
            r = seg.rows
            q, k, v = (self._short_conv(raw[i][r], i, st.conv[i]) for i in range(3))
            q = l2norm(q, o.l2_eps) * o.head_dim ** -0.5
            k = l2norm(k, o.l2_eps)
            if seg.length == 1:  # decode: the plain recurrence
                y, S = kda_recurrent(q, k, v, g[r], beta[r], st.S)
            else:
                group, nbytes = chunk_plan(o.heads, seg.length, o.chunk, o.head_dim, o.head_dim,
                                           scratch_budget(self.memory, CHUNK_SCRATCH))
                with scratch(self.memory, nbytes, "KDA chunk scratch"):
                    y, S = kda_chunked(q, k, v, g[r], beta[r], st.S, o.chunk, group)
            out[r] = y
            st.S.copy_(S)
        y = rms_norm(out, self.o_norm, o.eps) * torch.sigmoid(self._gate(x))  # [T, H, dv]
        return linear(y.reshape(t, -1), self.o_proj)

    def _decode_batch(self, segs: list, raw: list[torch.Tensor], g: torch.Tensor, beta: torch.Tensor,
                      out: torch.Tensor, index: int) -> None:
        """One decode token for each of B sequences at once, the B x H heads through one recurrence step (the
        same arithmetic per head as one sequence at a time). Native: each sequence's conv window and state matrix
        are updated where they live; torch: they are stacked, stepped, and copied back."""
        o = self.opt
        b, h, d = len(segs), o.heads, o.head_dim
        states = [seg.state.slot(index, lambda s=seg.state: KDAState(o, s)) for seg in segs]
        rows = torch.tensor([seg.start for seg in segs])
        native = cpu.available()
        streams = []
        for i in range(3):
            if native:
                y = cpu.conv_decode([st.conv[i] for st in states], [raw[i][seg.start] for seg in segs],
                                    self.conv[i].squeeze(1))
            else:
                seq = torch.cat([torch.stack([st.conv[i] for st in states]), raw[i][rows].unsqueeze(1)], dim=1)
                y = (seq * self.conv[i].float().squeeze(1).T).sum(1)  # [B, C]; taps [C, K]
                for j, st in enumerate(states):
                    st.conv[i].copy_(seq[j, 1:])
            streams.append(F.silu(y).view(b, h, d))
        q = l2norm(streams[0], o.l2_eps) * d ** -0.5
        k = l2norm(streams[1], o.l2_eps)
        if native:
            out[rows] = cpu.kda_decode([st.S for st in states], q, k, streams[2], g[rows], beta[rows])
            return
        S = torch.stack([st.S for st in states]).view(b * h, d, -1)  # [B*H, dk, dv]
        y, S = kda_recurrent(q.view(1, b * h, d), k.view(1, b * h, d), streams[2].view(1, b * h, d),
                             g[rows].view(1, b * h, d), beta[rows].view(1, b * h), S)
        out[rows] = y.view(b, h, -1)
        for j, st in enumerate(states):
            st.S.copy_(S.view(b, h, d, -1)[j])

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-step log-decay g [T, H, dk] in fp32."""
        o = self.opt
        f = linear(linear(x, self.f_a), self.f_b).view(x.shape[0], o.heads, o.head_dim) + self.dt_bias.float()
        a = torch.exp(self.A_log.float()).view(o.heads, 1)
        if o.decay == "softplus":
            return -a * F.softplus(f)  # unbounded below
        return o.gate_lower_bound * torch.sigmoid(a * f)  # in (lb, 0)

    def _gate(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for wt in self.gate:
            h = linear(h, wt)
        return h.view(x.shape[0], self.opt.heads, self.opt.head_dim)

    def _short_conv(self, raw: torch.Tensor, i: int, window: torch.Tensor) -> torch.Tensor:
        """SiLU(causal depthwise conv) of one stream [n, C] -> [n, H, d], continuing from (and updating) `window`."""
        n, k = raw.shape[0], self.opt.conv_kernel
        seq = torch.cat([window, raw], dim=0)  # [K-1+n, C]: the previous kernel-1 inputs, then this segment
        taps = self.conv[i].float().squeeze(1)  # [C, K]; tap K-1 multiplies the current token
        y = (seq.unfold(0, k, 1) * taps).sum(-1)  # [n, C]
        window.copy_(seq[seq.shape[0] - (k - 1):])
        return F.silu(y).view(n, self.opt.heads, self.opt.head_dim)


def l2norm(z: torch.Tensor, eps: float) -> torch.Tensor:
    """z / sqrt(sum z^2 + eps) over the last dim (sum, not mean; eps inside the root as in FLA)."""
    return z / torch.sqrt((z * z).sum(-1, keepdim=True) + eps)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token delta rule. q, k [n, H, dk] (q scaled), v [n, H, dv], g [n, H, dk], beta [n, H],
    S [H, dk, dv]. Returns (o [n, H, dv], S after the last token)."""
    out = torch.empty(v.shape)
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t]).unsqueeze(-1)  # decay each key channel's row
        u = beta[t].unsqueeze(-1) * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))  # [H, dv]
        S = S + k[t].unsqueeze(-1) * u.unsqueeze(-2)
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return out, S


def chunk_plan(heads: int, n: int, chunk: int, dk: int, dv: int, budget: int) -> tuple[int, int]:
    """(heads per group, scratch bytes) of kda_chunked on an n-token segment: per head of a group, one chunk's
    [c, c, dk] decay scratch, three [c, c] matrices (a_kk, a_qk, the triangular system), the [c, dk] / [c, dv]
    temporaries (G, decayed q and k, rhs, u, output) and the state update; as many heads as fit `budget`, at least
    one (then over it: the caller charges the excess). The [H, n, dv] output and the state copy are outputs."""
    c = min(chunk, n)
    per_head = 4 * (c * c * dk + 3 * c * c + 4 * c * dk + 3 * c * dv + 2 * dk * dv)
    group = min(heads, max(1, budget // per_head))
    return group, group * per_head


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                S: torch.Tensor, chunk: int = 64, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same delta rule in chunks (same arguments as kda_recurrent); any length, the last chunk may be short.
    `group` heads at a time bound the scratch (default: chunk_plan's for CHUNK_SCRATCH)."""
    heads = q.shape[1]
    if group is None:
        group, _ = chunk_plan(heads, q.shape[0], chunk, q.shape[2], v.shape[2], CHUNK_SCRATCH)
    hm = [z.transpose(0, 1) for z in (q, k, v, g, beta)]  # head-major [H, n, *]
    out = torch.empty(heads, q.shape[0], v.shape[2])
    S = S.clone()
    for h0 in range(0, heads, group):
        hs = slice(h0, min(heads, h0 + group))
        for s in range(0, q.shape[0], chunk):
            ts = slice(s, min(q.shape[0], s + chunk))
            out[hs, ts], S[hs] = _chunk(*(z[hs, ts] for z in hm), S[hs])
    return out.transpose(0, 1), S


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, head-major: q, k, g [H, c, dk], v [H, c, dv], beta [H, c], S [H, dk, dv] at the chunk start.

    With G the cumulative log-decay inside the chunk, every exponent is a difference G_i - G_j (j <= i) or
    G_i - G_start, so it is <= 0: nothing overflows however strong the decay (e^G_i * e^-G_j would)."""
    c = q.shape[1]
    G = g.cumsum(1)  # [H, c, dk]
    upper = torch.ones(c, c, dtype=torch.bool).triu(1)  # j > i: no contribution
    # the one [H, i, j, dk] scratch tensor, built in place: G_i - G_j -> e^(G_i - G_j) -> e^(G_i - G_j) k_j
    kd = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill_(upper[..., None], float("-inf")).exp_().mul_(k.unsqueeze(1))
    a_kk = torch.matmul(kd, k.unsqueeze(-1)).squeeze(-1).tril(-1)  # [H, c, c]: k_i . (e^(G_i-G_j) k_j), j < i
    a_qk = torch.matmul(kd, q.unsqueeze(-1)).squeeze(-1)  # [H, c, c]: q_i . (e^(G_i-G_j) k_j), j <= i
    # the pre-update deltas u_i = beta_i (v_i - k_i^T S_{i-1}) solve a unit lower-triangular system
    lhs = torch.eye(c) + beta.unsqueeze(-1) * a_kk
    rhs = beta.unsqueeze(-1) * (v - torch.matmul(k * G.exp(), S))  # [H, c, dv]
    u = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    out = torch.matmul(q * G.exp(), S) + torch.matmul(a_qk, u)  # [H, c, dv]
    last = G[:, -1:]  # [H, 1, dk]
    S = S * last.transpose(1, 2).exp() + torch.matmul((k * (last - G).exp()).transpose(1, 2), u)
    return out, S
