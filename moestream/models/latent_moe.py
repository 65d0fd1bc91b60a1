"""Kimi K3's latent MoE: sigmoid router on the full width, routed experts in a narrower latent space.

Owns the routing rule (the correction bias selects, the unbiased scores weigh), the latent down-projection,
the SiTU expert computed straight from MXFP4 (or bf16) bytes, the latent norm, the up-projection and the
shared experts on the full width. Expert bytes come through the ExpertRunner; no expanded copy is cached.
"""
from __future__ import annotations

from typing import Callable

import torch

from moestream.kernels.quant import mxfp4_linear
from moestream.models.blocks import glu_mlp, linear, rms_norm, sigmoid_topk, situ_glu

Act = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_act(beta: float, linear_beta: float) -> Act:
    return lambda gate, up: situ_glu(gate, up, beta, linear_beta)


def route(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k of sigmoid(logits) + bias; weights are the unbiased scores, renormalised (+1e-20), times scale."""
    return sigmoid_topk(logits, bias, k, renormalize=True, scale=scale)


def latent_norm(y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(y, w, eps)


def mxfp4_expert(act: Act) -> Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]:
    """One expert on latent rows z [n, latent]: w2 act(w1 z, w3 z), decoding the packed bytes per call."""

    def fn(z: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
        gate = mxfp4_linear(z, t["w1_packed"], t["w1_scale"])  # [n, I]
        up = mxfp4_linear(z, t["w3_packed"], t["w3_scale"])
        return mxfp4_linear(act(gate, up), t["w2_packed"], t["w2_scale"])  # [n, latent]

    return fn


def dense_expert(act: Act) -> Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]:
    return lambda z, t: glu_mlp(z, t["w1"], t["w3"], t["w2"], act)


class LatentMoE:
    """The feed-forward of one MoE layer (spec 2.4): x [T, H] -> [T, H] fp32."""

    def __init__(self, ctx, layer: int, top_k: int, scale: float, use_norm: bool, eps: float, act: Act,
                 quantized: bool):
        w, p = ctx.weights, f"model.layers.{layer}.block_sparse_moe"
        self.runner, self.layer, self.top_k, self.scale, self.eps = ctx.experts, layer, top_k, scale, eps
        self.gate, self.bias = w.get(f"{p}.gate.weight"), w.get(f"{p}.gate.e_score_correction_bias")
        self.down, self.up = w.get(f"{p}.routed_expert_down_proj.weight"), w.get(f"{p}.routed_expert_up_proj.weight")
        self.norm = w.get(f"{p}.routed_expert_norm.weight") if use_norm else None
        names = [f"{p}.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")]
        self.shared = [w.get(n) for n in names] if names[0] in w else None
        self.act = act
        self.fn = mxfp4_expert(act) if quantized else dense_expert(act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(linear(x, self.gate), self.bias, self.top_k, self.scale)  # [T, k] each
        z = linear(x, self.down)  # [T, latent]
        y = self.runner.run(self.layer, z, ids, weights, self.fn, out_dim=self.down.shape[0])  # [T, latent]
        if self.norm is not None:
            y = latent_norm(y, self.norm, self.eps)
        y = linear(y, self.up)  # [T, H]
        if self.shared is not None:
            y = y + glu_mlp(x, *self.shared, act=self.act)
        return y
