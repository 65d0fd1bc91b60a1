"""Differentiable KDA (gated delta rule with per-channel decay) for training: a chunked form and a naive loop.

Owns the sequence math only: q, k already normalised, g the per-channel log-decay, beta the write strength.
The chunked form (UT transform, one triangular solve per chunk) is what training uses; the step-by-step loop is
the definition it is tested against. Decay factors are anchored at each chunk's middle, so with chunks of at most
16 tokens and decays >= -5 per step nothing leaves fp32 range. Inference has its own implementation in
moestream/models; this one exists to be backpropagated.
"""
from __future__ import annotations

import torch


def naive_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """q, k, g [B, T, H, Dk]; v [B, T, H, Dv]; beta [B, T, H]. Returns o [B, T, H, Dv] (zero initial state)."""
    b, t, h, dk = k.shape
    s = q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for i in range(t):
        s = s * g[:, i].exp().unsqueeze(-1)  # decay each key channel
        pred = torch.einsum("bhk,bhkv->bhv", k[:, i], s)
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i].unsqueeze(-1) * (v[:, i] - pred))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], s))
    return torch.stack(outs, dim=1)


def chunked_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  chunk: int = 16) -> torch.Tensor:
    """Same contract as `naive_delta`; sequential only across chunks of `chunk` tokens."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:  # zero k/q/beta and zero decay: padded steps leave the state untouched and are dropped
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    n = (t + pad) // chunk
    # [B, H, N, C, D]: chunks side by side so all intra-chunk work is batched
    q, k, v, g = (x.view(b, n, chunk, h, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.view(b, n, chunk, h).permute(0, 3, 1, 2)  # [B, H, N, C]
    gam = g.cumsum(-2)  # cumulative log-decay inside each chunk, [B, H, N, C, Dk]
    # exp(Gamma_i - Gamma_j) = exp(Gamma_i - m) * exp(m - Gamma_j) with m the chunk's middle: each factor stays
    # within exp(+-|gate_lower_bound| * chunk / 2), finite in fp32 for chunks up to 16 with a -5 bound.
    mid = gam[..., chunk // 2: chunk // 2 + 1, :]
    up, down = (gam - mid).exp(), (mid - gam).exp()
    kk = ((k * up) @ (k * down).transpose(-1, -2)).tril(-1)  # A_ij, j < i, [B, H, N, C, C]
    qk = ((q * up) @ (k * down).transpose(-1, -2)).tril()  # B_ij, j <= i
    tri = torch.eye(chunk) + beta.unsqueeze(-1) * kk  # (I + diag(beta) A), unit lower triangular
    rhs = torch.cat([beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * (k * gam.exp())], dim=-1)
    w = torch.linalg.solve_triangular(tri, rhs, upper=False, unitriangular=True)
    w_v, w_k = w[..., :dv], w[..., dv:]  # u = w_v - w_k @ S0, [B, H, N, C, Dv] and [B, H, N, C, Dk]
    q_dec = q * gam.exp()  # q decayed back to the chunk start
    k_end = k * (gam[..., -1:, :] - gam).exp()  # k decayed forward to the chunk end
    s = q.new_zeros(b, h, dk, dv)
    outs = []
    for c in range(n):
        u = w_v[:, :, c] - w_k[:, :, c] @ s  # [B, H, C, Dv]
        outs.append(q_dec[:, :, c] @ s + qk[:, :, c] @ u)
        s = s * gam[:, :, c, -1].exp().unsqueeze(-1) + k_end[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2)  # [B, H, N, C, Dv]
    return o.permute(0, 2, 3, 1, 4).reshape(b, n * chunk, h, dv)[:, :t]
