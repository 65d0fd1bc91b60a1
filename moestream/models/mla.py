"""Multi-head latent attention (MLA): DeepSeek-V2/V3, Kimi K2, Kimi Linear and Kimi K3.

Owns the MLA projections (low-rank or direct q, the shared latent [c | k_r], per-head expansion through kv_b),
optional rope on the 64-wide part (DeepSeek) or none (NoPE: Kimi Linear, K3), the optional sigmoid output gate
(K3), and the decode cache, which keeps only [c (normed) | k_r (roped)] per token (in the sequence's kv dtype).
Attention runs either on keys expanded through kv_b or in the absorbed form (q folded through kv_b's key half,
the latent context through its value half); both are exact up to rounding, both walk the cache in key tiles with
an online softmax. kv_b's per-head matrices are prepared once at load (latent_heads.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moestream.memory.state import Batch, GrowingBuffer, Segment
from moestream.errors import UnsupportedModelError
from moestream.models.blocks import linear, rms_norm
from moestream.models.latent_heads import LatentHeads
from moestream.models.rope import Rope

MODES = ("auto", "expand", "absorb")
EXPAND_LIMIT = 1 << 24  # max expanded k/v elements (keys * H * (dn + dv)) before auto mode absorbs instead
SCORE_BLOCK = 1 << 22  # max score elements (H * queries * keys) of one key tile: 16 MiB in fp32
MIN_KEY_TILE = 64  # keys per tile at least (a query block shrinks before a tile does)
BATCH_PAD_LIMIT = 1 << 22  # max padded latent elements (sequences * longest cache * width) for batched decode


@dataclass
class MLAOptions:
    heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a direct q_proj (Kimi Linear)
    rope: Rope | None = None  # None: NoPE, the rope columns still score but are never rotated
    scale: float | None = None  # softmax scale; default (nope + rope)^-0.5 (DeepSeek passes its mscale^2 one)
    output_gate: bool = False  # K3: concat heads * sigmoid(g_proj x) before o_proj
    latent_eps: float = 1e-6  # eps of q_a_layernorm and kv_a_layernorm
    mode: str = "auto"  # "expand", "absorb", or "auto" (cheaper of the two per segment)

    @classmethod
    def from_hf(cls, c: dict, **overrides) -> "MLAOptions":
        """The MLA shape fields of an HF config (DeepSeek / Kimi names and defaults); overrides win."""
        opts = cls(heads=c["num_attention_heads"], kv_lora_rank=c.get("kv_lora_rank", 512),
                   qk_nope_head_dim=c.get("qk_nope_head_dim", 128), qk_rope_head_dim=c.get("qk_rope_head_dim", 64),
                   v_head_dim=c.get("v_head_dim") or 128, q_lora_rank=c.get("q_lora_rank"))
        for k, v in overrides.items():
            setattr(opts, k, v)
        return opts

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


class MLASlot:
    """One sequence's MLA cache for one layer: rows [c | k_r], kv_lora_rank + rope_dim numbers per token."""

    def __init__(self, memory, width: int, dtype: torch.dtype = torch.float32):
        self.latents = GrowingBuffer(memory, (width,), "MLA latent cache", dtype)


class MLAMixer:
    """An MLA attention block built from HF tensor names under `prefix` (e.g. model.layers.3.self_attn)."""

    def __init__(self, w, prefix: str, opt: MLAOptions):
        if opt.mode not in MODES:
            raise UnsupportedModelError(f"MLA mode {opt.mode!r} is not one of {MODES}")
        p = prefix
        self.opt, self.memory = opt, w.memory
        if opt.q_lora_rank is None:
            self.q_proj = w.get(f"{p}.q_proj.weight")
        else:
            self.q_a, self.q_a_bias = w.get(f"{p}.q_a_proj.weight"), w.maybe(f"{p}.q_a_proj.bias")
            self.q_a_norm, self.q_b = w.get(f"{p}.q_a_layernorm.weight"), w.get(f"{p}.q_b_proj.weight")
        self.kv_a, self.kv_a_bias = w.get(f"{p}.kv_a_proj_with_mqa.weight"), w.maybe(f"{p}.kv_a_proj_with_mqa.bias")
        self.kv_a_norm, self.kv_b = w.get(f"{p}.kv_a_layernorm.weight"), w.get(f"{p}.kv_b_proj.weight")
        self.g_proj = w.get(f"{p}.g_proj.weight") if opt.output_gate else None
        self.o_proj, self.o_bias = w.get(f"{p}.o_proj.weight"), w.maybe(f"{p}.o_proj.bias")
        streamer = getattr(w.memory, "streamer", None)
        streamed = streamer is not None and streamer.streams(f"{p}.kv_b_proj.weight")
        self.heads = LatentHeads(self.kv_b, opt.heads, opt.qk_nope_head_dim, opt.v_head_dim, opt.kv_lora_rank,
                                 None if streamed else w.memory)

    def __call__(self, x: torch.Tensor, batch: Batch, index: int) -> torch.Tensor:
        o = self.opt
        t, r = x.shape[0], o.kv_lora_rank
        q_nope, q_r = self._queries(x).split([o.qk_nope_head_dim, o.qk_rope_head_dim], dim=-1)  # [T, H, dn|dr]
        ckr = linear(x, self.kv_a, self.kv_a_bias)  # [T, r + dr]
        c, k_r = rms_norm(ckr[:, :r], self.kv_a_norm, o.latent_eps), ckr[:, r:]
        if o.rope is not None:
            cos, sin = o.rope.cos_sin(batch.positions)
            q_r = o.rope.apply(q_r, cos, sin)
            k_r = o.rope.apply(k_r.unsqueeze(1), cos, sin).squeeze(1)  # k_r is shared by all heads
        latents = torch.cat([c, k_r], dim=-1)  # [T, r + dr]
        caches = []
        for seg in batch.segments:
            slot = seg.state.slot(index, lambda: MLASlot(self.memory, r + o.qk_rope_head_dim, seg.state.kv_dtype))
            caches.append(slot.latents.append(latents[seg.rows]))  # [L, r + dr]
        if self._batched_decode(batch, caches):
            out = self._decode_batch(q_nope, q_r, caches)
        else:
            out = torch.empty(t, o.heads, o.v_head_dim)
            for seg, cache in zip(batch.segments, caches):
                out[seg.rows] = self._attend(seg, q_nope[seg.rows], q_r[seg.rows], cache)
        y = out.reshape(t, -1)
        if self.g_proj is not None:
            y = y * torch.sigmoid(linear(x, self.g_proj))
        return linear(y, self.o_proj, self.o_bias)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        o = self.opt
        if o.q_lora_rank is None:
            q = linear(x, self.q_proj)
        else:
            q = linear(rms_norm(linear(x, self.q_a, self.q_a_bias), self.q_a_norm, o.latent_eps), self.q_b)
        return q.view(x.shape[0], o.heads, o.qk_nope_head_dim + o.qk_rope_head_dim)

    def _attend(self, seg: Segment, q_nope: torch.Tensor, q_r: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """One segment's queries [n, H, *] over its whole cache [L, r + dr] -> [n, H, dv], key tile by key tile."""
        o, r = self.opt, self.opt.kv_lora_rank
        if self._absorb(q_nope.shape[0], cache.shape[0]):
            def latent_tile(l0: int, l1: int):  # the shared latent is both key and value: [1, k, r]
                rows = cache[l0:l1].float()
                return rows[:, :r].unsqueeze(0), rows[:, r:], rows[:, :r].unsqueeze(0)

            q_c = self.heads.fold_query(q_nope.transpose(0, 1))  # [H, n, r]: q_nope through kv_b's key half
            ctx = tiled_causal_attention(q_c, q_r.transpose(0, 1), latent_tile, cache.shape[0], r, seg.pos,
                                         o.softmax_scale)  # [H, n, r]
            return self.heads.unfold_context(ctx).transpose(0, 1)  # latent context through kv_b's value half

        def expanded_tile(l0: int, l1: int):  # per-head keys and values of this tile only
            rows = cache[l0:l1].float()
            keys, values = self.heads.expand(rows[:, :r])
            return keys, rows[:, r:], values

        ctx = tiled_causal_attention(q_nope.transpose(0, 1), q_r.transpose(0, 1), expanded_tile, cache.shape[0],
                                     o.v_head_dim, seg.pos, o.softmax_scale)  # [H, n, dv]
        return ctx.transpose(0, 1)

    def _batched_decode(self, batch: Batch, caches: list[torch.Tensor]) -> bool:
        """Several sequences with one new token each (a decode step) and short enough caches go through one
        padded, absorbed attention instead of one small attention per sequence."""
        if len(caches) < 2 or any(seg.length != 1 for seg in batch.segments):
            return False
        longest = max(c.shape[0] for c in caches)
        return self._absorb(1, longest) and len(caches) * longest * caches[0].shape[1] <= BATCH_PAD_LIMIT

    def _decode_batch(self, q_nope: torch.Tensor, q_r: torch.Tensor, caches: list[torch.Tensor]) -> torch.Tensor:
        """B single-token queries [B, H, *] over their own caches, padded to the longest: -> [B, H, dv].

        Row b attends to the first len(caches[b]) latents (its whole cache: the new token is the last one), so
        the causal mask is only the padding mask; padded keys get probability exactly 0."""
        o = self.opt
        lens = torch.tensor([c.shape[0] for c in caches])
        padded = torch.nn.utils.rnn.pad_sequence([c.float() for c in caches], batch_first=True)  # [B, Lmax, r+dr]
        q_c = self.heads.fold_query(q_nope.transpose(0, 1)).transpose(0, 1)  # [B, H, r]
        q = torch.cat([q_c, q_r], dim=-1)  # [B, H, r + dr]
        scores = torch.bmm(q, padded.transpose(1, 2)) * o.softmax_scale  # [B, H, Lmax]
        pad = torch.arange(padded.shape[1]).unsqueeze(0) >= lens.unsqueeze(1)  # [B, Lmax]
        probs = torch.softmax(scores.masked_fill(pad.unsqueeze(1), float("-inf")), dim=-1)
        ctx = torch.bmm(probs, padded[:, :, :o.kv_lora_rank])  # [B, H, r]
        return self.heads.unfold_context(ctx.transpose(0, 1)).transpose(0, 1)

    def _absorb(self, n: int, length: int) -> bool:
        """Absorbed form when it costs fewer multiplies (decode) or expanded keys would be large (long cache)."""
        o = self.opt
        if o.mode != "auto":
            return o.mode == "absorb"
        r, dn, dr, dv = o.kv_lora_rank, o.qk_nope_head_dim, o.qk_rope_head_dim, o.v_head_dim
        expand_cost = length * r * (dn + dv) + n * length * (dn + dr + dv)
        absorb_cost = n * r * (dn + dv) + n * length * (2 * r + dr)
        return absorb_cost <= expand_cost or length * o.heads * (dn + dv) > EXPAND_LIMIT


KeyTile = Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def tiled_causal_attention(q: torch.Tensor, q_r: torch.Tensor, tile: KeyTile, length: int, dv: int, pos0: int,
                           scale: float) -> torch.Tensor:
    """softmax((q . keys + q_r . k_r) * scale) @ values, causal from absolute position pos0, over key tiles with
    an online softmax: no score matrix longer than one tile, and keys past a query block's last position unread.

    q [H, n, d], q_r [H, n, dr]; tile(l0, l1) -> (keys [H or 1, k, d], k_r [k, dr], values [H or 1, k, dv]) for
    keys l0..l1-1 of `length`. Returns [H, n, dv]. (A general tiled attention may replace this function.)
    """
    h, n, _ = q.shape
    block = max(1, min(n, SCORE_BLOCK // (h * MIN_KEY_TILE)))
    out = torch.empty(h, n, dv)
    for s in range(0, n, block):
        e = min(n, s + block)
        stop = min(length, pos0 + e)  # the block's last query sees keys 0..pos0+e-1
        width = max(MIN_KEY_TILE, SCORE_BLOCK // (h * (e - s)))
        best = torch.full((h, e - s, 1), float("-inf"))
        total = torch.zeros(h, e - s, 1)
        acc = torch.zeros(h, e - s, dv)
        for l0 in range(0, stop, width):
            l1 = min(stop, l0 + width)
            keys, k_r, values = tile(l0, l1)
            scores = (torch.matmul(q[:, s:e], keys.transpose(-1, -2)) + torch.matmul(q_r[:, s:e], k_r.T)) * scale
            if l1 > pos0 + s:  # the tile reaches past the block's first query: mask what each query cannot see
                seen = torch.arange(l0, l1).unsqueeze(0) <= torch.arange(pos0 + s, pos0 + e).unsqueeze(1)
                scores.masked_fill_(~seen, float("-inf"))
            new_best = torch.maximum(best, scores.amax(-1, keepdim=True))  # finite: key 0 is in the first tile
            probs = torch.exp(scores - new_best)
            keep = torch.exp(best - new_best)
            total = total * keep + probs.sum(-1, keepdim=True)
            acc = acc * keep + torch.matmul(probs, values)
            best = new_best
        out[:, s:e] = acc / total
    return out
