"""Attention Residuals (AttnRes) and the Kimi K3 decoder that threads them through its layers.

Owns the per-position AttnRes read (a softmax over sealed block snapshots R and the live partial sum P), the K3
layer step on (P, R) with sealing every `attn_res_block_size` layers, and `K3Model`, whose `hidden()` carries
that state for each row of the flat batch. Nothing here persists across steps; mixers keep their own state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from moestream.memory.state import Batch
from moestream.models.base import DecoderModel
from moestream.models.blocks import rms_norm


def fold_query(norm_w: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    """The site's pseudo-query w_n * w_p as one fp32 vector [H] (keys carry no weight of their own)."""
    return norm_w.float() * proj_w.float().reshape(-1)


def attn_res_read(cands: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """sum_i softmax_i(rms(V_i) . query) V_i over candidates V_i [T, H] (live row last), fp32 [T, H].

    The score uses the RMS-normalised candidate; the sum uses the raw one."""
    scores = torch.stack([(v.float() @ query) * torch.rsqrt(v.float().pow(2).mean(-1) + eps)
                          for v in cands])  # [S+1, T]
    p = torch.softmax(scores, dim=0)
    out = torch.zeros_like(cands[-1], dtype=torch.float32)
    for i, v in enumerate(cands):
        out.add_(p[i].unsqueeze(-1) * v)  # [T, H]
    return out


def seals_at(layer: int, block: int) -> bool:
    """Layer l seals P into R (after its first read) when l % block == 0: layers, not sublayers, count."""
    return layer % block == 0


@dataclass
class K3Layer:
    """One K3 decoder layer on the AttnRes state (P, R) (spec 2.1 steps 1-5); R is extended in place."""

    mixer: Callable[[torch.Tensor, Batch, int], torch.Tensor]
    ffn: Callable[[torch.Tensor], torch.Tensor]
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    attn_query: torch.Tensor  # [H] folded self_attention_res_{norm,proj}
    mlp_query: torch.Tensor  # [H] folded mlp_res_{norm,proj}
    seals: bool
    eps: float

    def __call__(self, P: torch.Tensor, R: list[torch.Tensor], batch: Batch, index: int) -> torch.Tensor:
        a = attn_res_read(R + [P], self.attn_query, self.eps) if R else P
        live: torch.Tensor | None = P
        if self.seals:
            R.append(P)
            live = None
        u = self.mixer(rms_norm(a, self.in_norm, self.eps), batch, index)
        P = u if live is None else live + u
        b = attn_res_read(R + [P], self.mlp_query, self.eps)
        return P + self.ffn(rms_norm(b, self.post_norm, self.eps))


@dataclass
class K3Model(DecoderModel):
    out_query: Any = None  # [H] folded model.output_attn_res_{norm,proj}
    block: int = 12

    def hidden(self, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The output AttnRes read [T, H]; head() then applies model.norm and lm_head."""
        P = self.embed(tokens)  # [T, H]
        R: list[torch.Tensor] = []
        # the sealed snapshots are transient per step, but at prefill they are large: count them while alive
        nbytes = sum(1 for layer in self.layers if layer.seals) * P.numel() * 4
        self.memory.grow_state(nbytes, "AttnRes block snapshots")
        try:
            for i, layer in enumerate(self.layers):
                self.enter_layer(i)
                P = layer(P, R, batch, i)
                self.leave_layer(i)
            return attn_res_read(R + [P], self.out_query, self.eps)
        finally:
            self.memory.release_state(nbytes)
