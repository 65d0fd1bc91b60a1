"""Multi-head latent attention (MLA): DeepSeek-V2/V3, Kimi K2, Kimi Linear and Kimi K3.

Owns the MLA projections (low-rank or direct q, the shared latent [c | k_r], per-head expansion through kv_b),
optional rope on the 64-wide part (DeepSeek) or none (NoPE: Kimi Linear, K3), the optional sigmoid output gate
(K3), and the decode cache, which keeps only [c (normed) | k_r (roped)] per token (in the sequence's kv dtype).
Attention runs either on keys expanded through kv_b or in the absorbed form (q folded through kv_b's key half,
the latent context through its value half); both are exact up to rounding, and both walk the cache's blocks in key
tiles with tiled.attend_tiles' online softmax: no copy of the whole cache is made, and tile scratch beyond the
scratch allowance is charged. kv_b's per-head matrices are prepared once at load (latent_heads.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moestream.errors import UnsupportedModelError
from moestream.memory.state import Batch, BlockBuffer, Segment, scratch, scratch_budget, transient
from moestream.models.blocks import linear, rms_norm
from moestream.models.latent_heads import LatentHeads
from moestream.models.rope import Rope
from moestream.models.tiled import Tiles, attend_tiles, tile_plan

MODES = ("auto", "expand", "absorb")
EXPAND_LIMIT = 1 << 24  # max expanded k/v elements (keys * H * (dn + dv)) before auto mode absorbs instead
# scratch one attention call plans its tiles in (tiled.tile_plan; under a budget, the scratch allowance caps it):
# expanded tiles of K3's 96 heads need ~32 MiB for 128 keys; an absorbed decode tile of 512 latents ~5 MiB
TILE_BYTES_MLA = 64 << 20
EXPAND_KEY_TILE = 64  # keys per expanded tile at most (a query block re-expands them, so blocks should be tall)
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
        self.latents = BlockBuffer(memory, (width,), "MLA latent cache", dtype)


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
        bufs = []
        for seg in batch.segments:
            slot = seg.state.slot(index, lambda: MLASlot(self.memory, r + o.qk_rope_head_dim, seg.state.kv_dtype))
            slot.latents.push(latents[seg.rows])  # the cache's blocks are read in tiles, never gathered whole
            bufs.append(slot.latents)
        if self._batched_decode(batch, bufs):
            out = self._decode_batch(q_nope, q_r, bufs)
        else:
            out = torch.empty(t, o.heads, o.v_head_dim)
            for seg, buf in zip(batch.segments, bufs):
                out[seg.rows] = self._attend(seg, q_nope[seg.rows], q_r[seg.rows], buf)
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

    def _attend(self, seg: Segment, q_nope: torch.Tensor, q_r: torch.Tensor, buf: BlockBuffer) -> torch.Tensor:
        """One segment's queries [n, H, *] over its cache's blocks -> [n, H, dv], key tile by key tile (online
        softmax, tiles sized to the scratch allowance; the excess is charged while it exists)."""
        o, r, n = self.opt, self.opt.kv_lora_rank, q_nope.shape[0]
        h, dr = o.heads, o.qk_rope_head_dim
        budget = scratch_budget(self.memory, TILE_BYTES_MLA)
        if self._absorb(n, buf.kept):  # the shared latent row [c | k_r] is the key of every head, c its value
            q = torch.cat([self.heads.fold_query(q_nope.transpose(0, 1)), q_r.transpose(0, 1)], -1)  # [H, n, r+dr]
            rows, keys, nbytes = tile_plan(h, 1, n, buf.kept, r + dr, r, budget)

            def latent_tile(first: int, lat: torch.Tensor):
                lat = lat.unsqueeze(0).unsqueeze(0)  # [1, 1, k, r + dr]
                return first, lat, lat[..., :r]

            with scratch(self.memory, nbytes, "MLA attention scratch"):
                ctx = attend_tiles(q.unsqueeze(0), latent_tiles(buf, keys, latent_tile), seg.pos, o.softmax_scale,
                                   None, None, rows, r)  # [1, H, n, r]
            return self.heads.unfold_context(ctx[0]).transpose(0, 1)  # latent context through kv_b's value half

        def expanded_tile(first: int, lat: torch.Tensor):  # per-head keys [nope | shared rope] and values
            keys, values = self.heads.expand(lat[:, :r])  # [H, k, dn], [H, k, dv]
            k_r = lat[:, r:].unsqueeze(0).expand(h, -1, -1)
            return first, torch.cat([keys, k_r], -1).unsqueeze(0), values.unsqueeze(0)

        q = torch.cat([q_nope, q_r], -1).transpose(0, 1).unsqueeze(0)  # [1, H, n, dn + dr]
        # every query block expands its key tiles again: narrow tiles, and as many query rows as then fit
        rows, keys, nbytes = tile_plan(h, h, n, min(buf.kept, EXPAND_KEY_TILE), o.qk_nope_head_dim + dr,
                                       o.v_head_dim, budget)
        with scratch(self.memory, nbytes, "MLA attention scratch"):
            ctx = attend_tiles(q, latent_tiles(buf, keys, expanded_tile), seg.pos, o.softmax_scale, None, None, rows,
                               o.v_head_dim)
        return ctx[0].transpose(0, 1)

    def _batched_decode(self, batch: Batch, bufs: list[BlockBuffer]) -> bool:
        """Several sequences with one new token each (a decode step) and short enough caches go through one
        padded, absorbed attention instead of one small attention per sequence."""
        if len(bufs) < 2 or any(seg.length != 1 for seg in batch.segments):
            return False
        longest = max(b.kept for b in bufs)
        return self._absorb(1, longest) and len(bufs) * longest * bufs[0].row_shape[0] <= BATCH_PAD_LIMIT

    def _decode_batch(self, q_nope: torch.Tensor, q_r: torch.Tensor, bufs: list[BlockBuffer]) -> torch.Tensor:
        """B single-token queries [B, H, *] over their own caches, padded to the longest: -> [B, H, dv].

        Row b attends to the first len(bufs[b]) latents (its whole cache: the new token is the last one), so
        the causal mask is only the padding mask; padded keys get probability exactly 0. The padded fp32 copy
        (at most BATCH_PAD_LIMIT numbers) is written block by block and charged while it exists."""
        o = self.opt
        lens = torch.tensor([b.kept for b in bufs])
        width = bufs[0].row_shape[0]
        with transient(self.memory, len(bufs) * int(lens.max()) * width * 4, "MLA batched decode latents"):
            padded = torch.zeros(len(bufs), int(lens.max()), width)  # [B, Lmax, r + dr]
            for i, buf in enumerate(bufs):
                for first, lat in buf.tiles():
                    padded[i, first - buf.start:first - buf.start + lat.shape[0]] = lat
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


def latent_tiles(buf: BlockBuffer, rows: int,
                 make: Callable[[int, torch.Tensor], tuple[int, torch.Tensor, torch.Tensor]]) -> Tiles:
    """attend_tiles' key tiles over a latent cache: consecutive blocks merged (as fp32) up to `rows` latents,
    each turned into (first position, keys, values) by `make` -- one tile's copy at a time, never the cache's."""
    def tiles():
        parts, first, n = [], 0, 0
        for f, lat in buf.tiles(buf.tile_dtype):
            for s in range(0, lat.shape[0], rows):
                piece = lat[s:s + rows]
                if n + piece.shape[0] > rows:
                    yield make(first, torch.cat(parts).float())
                    parts, n = [], 0
                if not parts:
                    first = f + s
                parts.append(piece)
                n += piece.shape[0]
        if parts:
            yield make(first, torch.cat(parts).float())
    return tiles
