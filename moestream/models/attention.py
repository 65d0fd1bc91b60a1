"""Grouped-query softmax attention over a per-sequence KV cache (Mixtral, Qwen3-MoE, gpt-oss).

Owns the cache layout ([L, Hkv, D] rows appended per step), causal and sliding-window masks and attention
sinks. Projections, norms and rope are done by the caller; this module sees per-head q, k, v.
"""
from __future__ import annotations

import torch

from moestream.memory.state import GrowingBuffer, Segment
from moestream.errors import CheckpointError
from moestream.kernels import cpu, fused
from moestream.models.blocks import linear, linear_many, rms_norm

NATIVE_MAX_TOKENS = 16  # segments up to this long attend in one native call (decode); longer ones use torch bmm


def gqa_dims(c: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of an HF GQA config; missing KV heads / head_dim take HF's defaults."""
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    if heads % kv:
        raise CheckpointError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return heads, kv, c.get("head_dim") or c["hidden_size"] // heads


class KVSlot:
    def __init__(self, memory, hkv: int, dk: int, dv: int):
        self.k = GrowingBuffer(memory, (hkv, dk), "KV cache")
        self.v = GrowingBuffer(memory, (hkv, dv), "KV cache")


def causal_mask(pos0: int, t: int, length: int, window: int | None = None) -> torch.Tensor:
    """[t, length] bool: query i (absolute pos0 + i) may see key j."""
    q = torch.arange(pos0, pos0 + t).unsqueeze(1)
    k = torch.arange(length).unsqueeze(0)
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv], mask [T, L] -> [T, Hq, Dv], fp32 softmax.

    One batched matmul per KV head over its G query heads' rows (row g * T + t), reading k and v in place: a
    broadcast matmul expanded k to [Hkv, G, D, L] first, a temporary as large as the cache times G on every call
    (3x slower for a decode step)."""
    t, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.float().view(t, hkv, g, -1).permute(1, 2, 0, 3).reshape(hkv, g * t, -1)  # [Hkv, G*T, D]
    scores = torch.bmm(qg, k.float().permute(1, 2, 0)) * scale  # [Hkv, G*T, L]
    scores = scores.masked_fill(~(mask if g == 1 else mask.repeat(g, 1)), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hkv, g, 1, 1).expand(hkv, g, t, 1).reshape(hkv, g * t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, v.float().permute(1, 0, 2))  # [Hkv, G*T, Dv]
    return out.view(hkv, g, t, -1).permute(2, 0, 1, 3).reshape(t, hq, -1)


def cached_attention(seg: Segment, slot: KVSlot, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Append this segment's k, v to the cache and attend its queries over the whole cache."""
    keys = slot.k.append(k)
    values = slot.v.append(v)
    mask = causal_mask(seg.pos, q.shape[0], keys.shape[0], window)
    return attend(q, keys, values, mask, scale, sinks)


DECODE_PAD_BYTES = 16 << 20  # padded K+V copy one batched decode attention call may make (bounds the temporary)


def decode_attention(slots: list[KVSlot], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: append each k, v row to its cache, then attend every query at once over the
    caches padded to the longest (padding masked out, so the softmax is the per-sequence one). q [n, Hq, D],
    k [n, Hkv, D], v [n, Hkv, Dv] -> [n, Hq, Dv]. Replaces n small attention calls by a few batched ones; the
    padded copy is bounded by DECODE_PAD_BYTES per call."""
    keys = [s.k.append(k[i:i + 1]) for i, s in enumerate(slots)]
    values = [s.v.append(v[i:i + 1]) for i, s in enumerate(slots)]
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    row = (k[0].numel() + v[0].numel()) * 4
    start = 0
    while start < len(slots):
        longest, end = 0, start
        while end < len(slots) and (end == start or (end + 1 - start) * max(longest, keys[end].shape[0]) * row
                                    <= DECODE_PAD_BYTES):
            longest = max(longest, keys[end].shape[0])
            end += 1
        out[start:end] = _padded_decode(q[start:end], keys[start:end], values[start:end], scale, window, sinks)
        start = end
    return out


def _padded_decode(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
                   window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    n, hq, _ = q.shape
    kp = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)  # [n, L, Hkv, D]
    vp = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)  # [n, L, Hkv, Dv]
    hkv, length = kp.shape[2], kp.shape[1]
    g = hq // hkv
    lens = torch.tensor([t.shape[0] for t in keys])
    col = torch.arange(length).unsqueeze(0)
    allowed = col < lens.unsqueeze(1)  # [n, L]: the query is each sequence's last position
    if window is not None:
        allowed &= col > (lens - 1).unsqueeze(1) - window
    qg = q.float().view(n, hkv, g, -1)  # [n, Hkv, G, D]
    scores = torch.matmul(qg, kp.float().permute(0, 2, 3, 1)) * scale  # [n, Hkv, G, L]
    scores = scores.masked_fill(~allowed.view(n, 1, 1, length), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, g, 1).expand(n, hkv, g, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vp.float().permute(0, 2, 1, 3))  # [n, Hkv, G, Dv]
    return out.reshape(n, hq, -1)


class GQAMixer:
    """q/k/v/o projections (+ optional biases, per-head q/k RMSNorm, rope, window, sinks) over a KV cache."""

    def __init__(self, w, p: str, heads: int, kv_heads: int, head_dim: int, rope, eps: float = 1e-6,
                 qk_norm: bool = False, window: int | None = None, sinks: bool = False, scale: float | None = None):
        self.q, self.k, self.v, self.o = (w.get(f"{p}.{n}_proj.weight") for n in "qkvo")
        self.qb, self.kb, self.vb, self.ob = (w.maybe(f"{p}.{n}_proj.bias") for n in "qkvo")
        self.q_norm = w.get(f"{p}.q_norm.weight") if qk_norm else None
        self.k_norm = w.get(f"{p}.k_norm.weight") if qk_norm else None
        self.sinks = w.get(f"{p}.sinks") if sinks else None
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope, self.eps, self.window = rope, eps, window
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.memory = w.memory

    def __call__(self, x: torch.Tensor, batch, index: int) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = linear_many(x, (self.q, self.k, self.v), (self.qb, self.kb, self.vb))
        q = q.view(t, self.heads, self.head_dim)
        k, v = k.view(t, self.kv_heads, self.head_dim), v.view(t, self.kv_heads, self.head_dim)
        if self._native(x, batch):
            return linear(self._attend_native(q, k, v, batch, index).view(t, -1), self.o, self.ob)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        cos, sin = self.rope.cos_sin(batch.positions)
        q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
        out = torch.empty(t, self.heads, self.head_dim)
        new_slot = lambda: KVSlot(self.memory, self.kv_heads, self.head_dim, self.head_dim)  # noqa: E731
        single = [seg for seg in batch.segments if seg.length == 1 and seg.pos > 0]
        if len(single) < 2:
            single = []
        else:  # decoding sequences: one batched attention instead of one small call each
            rows = torch.tensor([seg.start for seg in single])
            slots = [seg.state.slot(index, new_slot) for seg in single]
            out[rows] = decode_attention(slots, q[rows], k[rows], v[rows], self.scale, self.window, self.sinks)
        done = {id(seg) for seg in single}
        for seg in batch.segments:
            if id(seg) not in done:
                r = seg.rows
                out[r] = cached_attention(seg, seg.state.slot(index, new_slot), q[r], k[r], v[r], self.scale,
                                          self.window, self.sinks)
        return linear(out.reshape(t, -1), self.o, self.ob)

    def _native(self, x: torch.Tensor, batch) -> bool:
        """Small segments, no sinks, rotate-half rope: q/k norms, rope, KV append and attention in one native call
        per sequence (instead of some thirty small torch ops)."""
        return (self.sinks is None and not self.rope.interleaved and not x.requires_grad and cpu.available()
                and self.rope.inv_freq.numel() * 2 == self.head_dim
                and all(seg.length <= NATIVE_MAX_TOKENS for seg in batch.segments))

    def _attend_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, index: int) -> torch.Tensor:
        one = len(batch.segments) == 1
        out = None if one else torch.empty(q.shape[0], self.heads, self.head_dim)
        for seg in batch.segments:
            slot = seg.state.slot(index, lambda: KVSlot(self.memory, self.kv_heads, self.head_dim, self.head_dim))
            r = seg.rows
            keys, values = slot.k.append(k[r]), slot.v.append(v[r])  # normed and roped in place by the kernel
            got = fused.gqa_attend(q[r].contiguous(), keys, values, seg.length, self.scale, self.q_norm, self.k_norm,
                                 self.eps, self.rope.inv_freq, self.rope.attention_factor, self.window)
            if one:
                return got
            out[r] = got
        return out
