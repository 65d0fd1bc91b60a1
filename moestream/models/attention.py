"""Grouped-query softmax attention over a per-sequence KV cache (Mixtral, Qwen3-MoE, gpt-oss).

Owns the cache layout ([Hkv, D] rows in a sequence's blocks, models/tiled.py's online softmax over them for
prefill; a whole prompt attending to itself goes to torch's fused flash attention kernel instead), causal and
sliding-window masks and attention sinks, the padded batched decode and the native decode call. Projections, norms and rope are done by the caller; this module sees per-head q, k, v.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moestream.memory.state import BLOCK_TOKENS, BlockBuffer, Segment, scratch, scratch_budget
from moestream.errors import CheckpointError
from moestream.kernels import cpu, fused, invariant, kvquant, paged
from moestream.kernels.b12 import B12Weight
from moestream.models.blocks import linear, linear_many, native_rows, rms_norm
from moestream.models.tiled import TILE_BYTES, Tiles, attend_tiles, tile_plan

NATIVE_MAX_TOKENS = 16  # segments up to this long attend in one native call (decode); longer ones use torch bmm
PAGED_MIN_SEQUENCES = 2  # this many sequences decoding together attend in one paged call (kernels/paged.py)


def gqa_dims(c: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of an HF GQA config; missing KV heads / head_dim take HF's defaults."""
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    if heads % kv:
        raise CheckpointError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return heads, kv, c.get("head_dim") or c["hidden_size"] // heads


class KVSlot:
    """One sequence's keys and values for one layer, in blocks of the sequence's KV dtype (a window drops old ones)."""

    def __init__(self, memory, hkv: int, dk: int, dv: int, dtype: torch.dtype = torch.float32,
                 window: int | None = None):
        self.k = BlockBuffer(memory, (hkv, dk), "KV cache", dtype, window)
        self.v = BlockBuffer(memory, (hkv, dv), "KV cache", dtype, window)


def cache_tiles(slot: KVSlot, rows: int) -> Tiles:
    """The cache as attend_tiles' key tiles: consecutive blocks merged up to `rows` keys, fp32 [1, Hkv, n, D]."""
    def merged(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p.permute(1, 0, 2) for p in parts], dim=1).float().unsqueeze(0)

    def pieces():  # (first position, k, v) of at most `rows` rows: blocks, cut when tiles are smaller
        for (f, k), (_, v) in zip(slot.k.tiles(slot.k.tile_dtype), slot.v.tiles(slot.v.tile_dtype)):
            for s in range(0, k.shape[0], rows):
                yield f + s, k[s:s + rows], v[s:s + rows]

    def tiles():
        ks, vs, first, n = [], [], 0, 0
        for f, k, v in pieces():
            if n + k.shape[0] > rows:
                yield first, merged(ks), merged(vs)
                ks, vs, n = [], [], 0
            if not ks:
                first = f
            ks.append(k)
            vs.append(v)
            n += k.shape[0]
        if ks:
            yield first, merged(ks), merged(vs)
    return tiles


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
                     window: int | None = None, sinks: torch.Tensor | None = None,
                     pre: tuple[kvquant.Quantized, kvquant.Quantized] | None = None) -> torch.Tensor:
    """Append this segment's k, v [T, Hkv, D] to the cache and attend its queries q [T, Hq, D] over the cache in
    key tiles (online softmax) sized to the scratch allowance (anything over it is charged while it exists)
    -> [T, Hq, Dv]. For a quantised cache, `pre` may carry k and v already quantised at its bits (a step's rows for
    all its sequences quantised in one call)."""
    t, hq, d = q.shape
    fresh = fresh_prompt(seg, slot, window, sinks)
    k_in, v_in = push_rows(slot, k, v, pre)
    if fresh:
        return _fresh_attention(slot, q, k_in, v_in, scale)
    memory = slot.k.memory
    rows, keys, nbytes = tile_plan(hq, k.shape[1], t, slot.k.kept, d, v.shape[-1], scratch_budget(memory, TILE_BYTES))
    with scratch(memory, nbytes, "attention scratch"):
        out = attend_tiles(q.permute(1, 0, 2).unsqueeze(0), cache_tiles(slot, keys), seg.pos, scale, window, sinks,
                           rows, v.shape[-1])
    return out[0].permute(1, 0, 2)


def fresh_prompt(seg: Segment, slot: KVSlot, window: int | None, sinks: torch.Tensor | None) -> bool:
    """A whole prompt attending to itself: its cache holds nothing yet, no window, no sinks (_fresh_attention)."""
    return window is None and sinks is None and seg.pos == 0 and slot.k.kept == 0


def push_rows(slot: KVSlot, k: torch.Tensor, v: torch.Tensor,
              pre: tuple[kvquant.Quantized, kvquant.Quantized] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append k, v to the cache (quantised with `pre` where given); returns them as the cache stores them (bf16
    rounded, int8 / int4 decoded), what a fresh prompt's attention reads."""
    pre_k, pre_v = pre if pre is not None and slot.k.quantized else (None, None)
    slot.k.push(k, pre_k)
    slot.v.push(v, pre_v)
    if pre_k is not None:
        return pre_k.decoded, pre_v.decoded
    if slot.k.dtype != torch.float32:
        return slot.k.stored(k), slot.v.stored(v)
    return k, v


FLASH_Q_SPLIT, FLASH_KV_SPLIT = 256, 512  # the largest query / key blocks of ATen's CPU flash attention kernel


def _fresh_attention(slot: KVSlot, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A whole prompt attending to itself (the cache held nothing before it; no window, no sinks): torch's fused
    flash attention kernel, causal, GQA grouped, which like attend_tiles never builds a score matrix (it works in
    blocks of at most FLASH_Q_SPLIT queries x FLASH_KV_SPLIT keys per thread with an online softmax), in a
    fraction of the small torch ops' time: a 512-token prompt's 16 layers took 0.8-1.7 s in attend_tiles
    (docs/performance.md). The caller passes keys and values as the cache stores them (bf16 caches round them, int8 /
    int4 caches quantise them), as the tiled path reads them. Its per-thread blocks and the output are charged as scratch
    while it runs."""
    return fresh_attention_many(slot, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale)[0]


FRESH_GROUP_BYTES = 16 << 20  # stacked q / k / v / output of same-length prompts in one flash attention call


def adjacent(parts: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """torch.stack(parts) as a view, where the parts are contiguous, of one shape and dtype, and lie one after
    another in one storage (same-length prompts in consecutive rows of a step's q, k or v); else None."""
    first = parts[0]
    n, size = first.numel(), first.element_size()
    if any(not p.is_contiguous() or p.shape != first.shape or p.dtype != first.dtype
           or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           or p.data_ptr() != first.data_ptr() + j * n * size for j, p in enumerate(parts)):
        return None
    return first.as_strided((len(parts), *first.shape), (n, *first.stride()), first.storage_offset())


def fresh_attention_many(slot: KVSlot, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`_fresh_attention` for n prompts of one length at once: q [n, T, Hq, D], k [n, T, Hkv, D], v [n, T, Hkv, Dv]
    -> [n, T, Hq, Dv], one flash call over a batch of n (a batch job's prefill chunk of 32 prompts made 32 calls a
    layer, each mostly the kernel's fixed cost). The kernel splits work by (batch, head, query block) and a row's
    blocks depend on the lengths alone, so each prompt's rows are bit for bit those of its own call (a test checks
    it). Charged like one call, with the n outputs."""
    n, t, hq, d = q.shape
    dv = v.shape[-1]
    block = min(t, FLASH_Q_SPLIT)
    nbytes = 4 * (torch.get_num_threads() * block * (min(t, FLASH_KV_SPLIT) + 2 * dv + 2) + n * t * hq * dv)
    with scratch(slot.k.memory, nbytes, "attention scratch"):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3),
                                                 v.permute(0, 2, 1, 3), is_causal=True, scale=scale,
                                                 enable_gqa=hq != k.shape[2])
    return out.permute(0, 2, 1, 3)


DECODE_PAD_BYTES = 16 << 20  # padded K+V copy one batched decode attention call may make (bounds the temporary)


def decode_attention(slots: list[KVSlot], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: append each k, v row to its cache, then attend every query at once over the
    caches padded to the longest (padding masked out, so the softmax is the per-sequence one). q [n, Hq, D],
    k [n, Hkv, D], v [n, Hkv, Dv] -> [n, Hq, Dv]. Replaces n small attention calls by a few batched ones; the
    padded copy is bounded by DECODE_PAD_BYTES per call."""
    for i, s in enumerate(slots):
        s.k.push(k[i:i + 1])
        s.v.push(v[i:i + 1])
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    row = (k[0].numel() + v[0].numel()) * 4
    start = 0
    while start < len(slots):
        longest, end = 0, start
        while end < len(slots) and (end == start or (end + 1 - start) * max(longest, slots[end].k.kept) * row
                                    <= DECODE_PAD_BYTES):
            longest = max(longest, slots[end].k.kept)
            end += 1
        pad = (end - start) * longest * (row + 4 * q.shape[1])  # padded K and V, the scores
        with scratch(slots[start].k.memory, pad, "batched decode attention"):
            out[start:end] = _padded_decode(q[start:end], slots[start:end], longest, scale, window, sinks)
        start = end
    return out


def _padded(bufs: list[BlockBuffer], longest: int) -> torch.Tensor:
    """[n, longest, *row] fp32: each buffer's held rows copied from its blocks, zero padding after."""
    out = torch.zeros(len(bufs), longest, *bufs[0].row_shape)
    for i, b in enumerate(bufs):
        for first, rows in b.tiles(b.tile_dtype):
            at = first - b.start
            out[i, at:at + rows.shape[0]] = rows
    return out


def _padded_decode(q: torch.Tensor, slots: list[KVSlot], longest: int, scale: float,
                   window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    n, hq, _ = q.shape
    kp = _padded([s.k for s in slots], longest)  # [n, L, Hkv, D]
    vp = _padded([s.v for s in slots], longest)  # [n, L, Hkv, Dv]
    hkv, length = kp.shape[2], kp.shape[1]
    g = hq // hkv
    lens = torch.tensor([s.k.kept for s in slots])
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
        self.decode_blocks = 0  # one-token steps done by decode_block's single native call
        self.row_blocks = 0  # short prompt chunks whose attention half took rows_block's single native call
        self._blocks: dict[tuple, fused.DecodeBlock | None] = {}
        self.prefetch_next: list[torch.Tensor] = []  # read ahead after each decode_block (DecoderModel links it)

    def decode_weights(self) -> list[torch.Tensor]:
        """The weights a decode step reads first, in that order (q, k, v, o), when they are plain (or b12-coded)."""
        return [m for m in (self.q, self.k, self.v, self.o) if type(m) in (torch.Tensor, B12Weight)]

    def __call__(self, x: torch.Tensor, batch, index: int) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = linear_many(x, (self.q, self.k, self.v), (self.qb, self.kb, self.vb))
        q = q.view(t, self.heads, self.head_dim)
        k, v = k.view(t, self.kv_heads, self.head_dim), v.view(t, self.kv_heads, self.head_dim)
        fixed = invariant.active()  # each sequence's attention by its own shape alone, never by its companions'
        if not fixed and self._native(x, batch):
            return linear(self._attend_native(q, k, v, batch, index).view(t, -1), self.o, self.ob)
        out = torch.empty(t, self.heads, self.head_dim)
        single = [seg for seg in batch.segments if seg.length == 1 and seg.pos > 0]
        if len(single) < (1 if fixed else PAGED_MIN_SEQUENCES):
            single = []
        paged_rows = bool(single) and self._kernel_fits(x) and self.window is None
        if fixed and not paged_rows:  # the padded batch call's shape depends on the others: one sequence at a time
            single = []
        rows = torch.tensor([seg.start for seg in single], dtype=torch.long)
        # the paged call norms and ropes its own rows: when they lead the step (the scheduler puts decoding
        # sequences first), the rest is done on the rows after them alone
        base = len(single) if paged_rows and all(seg.start == i for i, seg in enumerate(single)) else 0
        if paged_rows:  # a step that also prefills: its decoding sequences still take the one paged call
            lead = slice(0, base) if base else rows
            out[lead] = self._attend_paged(q[lead], k[lead], v[lead], single, index)
        # q and k (this call's own projections) are not read raw from here on: normed and roped in place
        qt, kt, vt = q[base:], k[base:], v[base:]
        if self.q_norm is not None:
            qt, kt = rms_norm(qt, self.q_norm, self.eps, out=qt), rms_norm(kt, self.k_norm, self.eps, out=kt)
        cos, sin = self.rope.cos_sin(batch.positions)
        qt = self.rope.apply(qt, cos[base:], sin[base:], inplace=True)
        kt = self.rope.apply(kt, cos[base:], sin[base:], inplace=True)
        if single and not paged_rows:  # decoding sequences: one batched attention instead of one small call each
            slots = [self.slot(seg, index) for seg in single]
            out[rows] = decode_attention(slots, qt[rows], kt[rows], vt[rows], self.scale, self.window, self.sinks)
        done = {id(seg) for seg in single}
        rest = [seg for seg in batch.segments if id(seg) not in done]
        pre = {}  # quantised storage's bits -> k and v quantised once for all the sequences of that storage
        for bits in {kvquant.bits_of(seg.state.kv_dtype) for seg in rest} - {0}:
            pre[bits] = (kvquant.quantized(kt, bits), kvquant.quantized(vt, bits))
        fresh: dict[int, list] = {}  # prompt length -> whole prompts over empty caches, attended in one call
        for seg in rest:
            r, slot = slice(seg.start - base, seg.start - base + seg.length), self.slot(seg, index)
            got = pre.get(kvquant.bits_of(seg.state.kv_dtype))
            got = None if got is None else (got[0].rows(r), got[1].rows(r))
            if not fixed and fresh_prompt(seg, slot, self.window, self.sinks):
                fresh.setdefault(seg.length, []).append((seg.rows, slot, qt[r], *push_rows(slot, kt[r], vt[r], got)))
                continue
            out[seg.rows] = cached_attention(seg, slot, qt[r], kt[r], vt[r], self.scale, self.window, self.sinks, got)
        for length, group in fresh.items():
            stacked = 4 * length * (qt.shape[1] * qt.shape[2] + kt.shape[1] * (kt.shape[2] + vt.shape[2]))
            step = max(1, FRESH_GROUP_BYTES // (stacked + 4 * length * qt.shape[1] * qt.shape[2]))  # and the output
            for i in range(0, len(group), step):
                where, slots, qs, ks, vs = zip(*group[i:i + step])
                views = [adjacent(parts) for parts in (qs, ks, vs)]  # prompts in consecutive rows: no copy
                copied = sum(parts[0].numel() * len(parts) * 4 for parts, v in zip((qs, ks, vs), views) if v is None)
                with scratch(slots[0].k.memory, copied, "stacked prompts' q, k, v"):
                    got = fresh_attention_many(slots[0], *[torch.stack(parts) if v is None else v
                                                           for parts, v in zip((qs, ks, vs), views)], self.scale)
                for r, o in zip(where, got):
                    out[r] = o
        return linear(out.reshape(t, -1), self.o, self.ob)

    def decode_block(self, h: torch.Tensor, batch, index: int, in_norm: torch.Tensor, post_norm: torch.Tensor,
                     eps: float, router=None, table: "fused.ExpertTable | None" = None):
        """A decoder layer's attention half for a step of one sequence's one token, in one native call
        (fused.DecodeBlock: norm, q/k/v, q/k norm + rope, KV append, attention, o_proj, residual, then the post
        norm and, given a SoftmaxRouter, its top-k; given also the router's ExpertTable, the routed experts when
        all are in it). Returns (h + attention [+ experts], post-norm x, ids, weights, experts done), ids and
        weights None without a router; None (nothing done) when the step or the layer does not fit (the caller
        then runs the layer the usual way)."""
        if not self.decode_fits(h, batch):
            return None
        seg = batch.segments[0]
        block = self._decode_plan(in_norm, post_norm, eps, router)
        if block is None:
            return None
        slot = self.slot(seg, index)
        if slot.k.block != BLOCK_TOKENS:
            return None
        slot.k.reserve(1)  # the row is charged and allocated here; the kernel writes its contents
        slot.v.reserve(1)
        self.decode_blocks += 1
        return block(h, slot.k.blocks, slot.v.blocks, slot.k.start, slot.k.length,
                     table if block.top_k else None)

    def rows_block(self, h: torch.Tensor, batch, index: int, in_norm: torch.Tensor, post_norm: torch.Tensor,
                   eps: float, router=None, table: "fused.ExpertTable | None" = None):
        """A decoder layer's attention half (and, given a SoftmaxRouter that fits, its top-k; given also the
        router's ExpertTable, the routed experts when all are in it) for a step of one sequence's 2-16 new tokens (a
        short prompt chunk), in one native call (fused.DecodeBlock.rows): what `__call__` between the layer's two
        norms, the router and the runner's grouped call compute on that step, bit for bit, without their Python.
        Returns (h + attention [+ experts], post-norm x2, ids, weights, experts done), ids and weights None without
        a router; None (nothing done) when the step or the layer does not fit (the caller runs the layer the usual
        way)."""
        if not self.rows_fit(h, batch):
            return None
        block = self._decode_plan(in_norm, post_norm, eps, router)
        if block is None:
            return None
        slot = self.slot(batch.segments[0], index)
        if slot.k.block != BLOCK_TOKENS or slot.k.start != 0:
            return None
        t = h.shape[0]
        slot.k.reserve(t)  # the rows are charged and allocated here; the kernel writes their contents
        slot.v.reserve(t)
        self.row_blocks += 1
        return block.rows(h, slot.k.blocks, slot.v.blocks, slot.k.start, slot.k.length,
                          table if block.top_k else None)

    def rows_fit(self, h: torch.Tensor, batch) -> bool:
        """Whether a step may take rows_block: one sequence's 2-16 new tokens over an fp32 cache, no window, every
        dense weight resident and multiplied by the native kernel in fp32 compute (blocks.native_rows), the native
        attention kernel's conditions (`_native`), no autograd."""
        t = h.shape[0]
        return (1 < t <= min(NATIVE_MAX_TOKENS, cpu.MAX_TOKENS_BF16) and len(batch.segments) == 1
                and batch.segments[0].length == t and batch.segments[0].state.kv_dtype == torch.float32
                and self.window is None and not h.requires_grad and self.memory.streamer is None
                and self._native(h, batch) and native_rows(h, (self.q, self.k, self.v, self.o)))

    def decode_fits(self, h: torch.Tensor, batch) -> bool:
        """Whether a step may take the one-call decode layer: one sequence's one token, an fp32 cache, no autograd,
        every dense weight resident (no streamer), and the native kernels."""
        return (h.shape[0] == 1 and len(batch.segments) == 1 and batch.segments[0].state.kv_dtype == torch.float32
                and not h.requires_grad and self.memory.streamer is None and cpu.available())

    def _decode_plan(self, in_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                     router) -> "fused.DecodeBlock | None":
        """The layer's DecodeBlock (built once per router), or None when its weights or options do not fit it:
        biases, sinks, interleaved rope, or weights that are not plain contiguous bf16 matrices."""
        key = (id(in_norm), id(post_norm), eps, id(router))
        if key in self._blocks:
            return self._blocks[key]
        weights = {"q": self.q, "k": self.k, "v": self.v, "o": self.o, "q_norm": self.q_norm, "k_norm": self.k_norm,
                   "inv_freq": self.rope.inv_freq, "in_norm": in_norm, "post_norm": post_norm}
        block = None
        if (self.sinks is None and not self.rope.interleaved and all(b is None for b in (self.qb, self.kb, self.vb, self.ob))
                and all(type(m) in (torch.Tensor, B12Weight) for m in (self.q, self.k, self.v, self.o))):
            options = [(router.weight, router.top_k, router.renormalize)] if router is not None else []
            for gate, top_k, renorm in options + [(None, 0, False)]:  # without the router if only it does not fit
                try:
                    block = fused.DecodeBlock({**weights, "router": gate}, self.heads, self.kv_heads, self.head_dim,
                                              eps, self.rope.attention_factor, self.scale, self.window, BLOCK_TOKENS,
                                              top_k, renorm)
                    break
                except ValueError:
                    continue
        if block is not None and self.prefetch_next:
            block.prefetch_after(self.prefetch_next)
        self._blocks[key] = block
        return block

    def slot(self, seg: Segment, index: int) -> KVSlot:
        """This layer's cache of the segment's sequence (created in the sequence's KV dtype on first use)."""
        return seg.state.slot(index, lambda: KVSlot(self.memory, self.kv_heads, self.head_dim, self.head_dim,
                                                    seg.state.kv_dtype, self.window))

    def _native(self, x: torch.Tensor, batch) -> bool:
        """Small segments, no sinks, rotate-half rope, a cache that still starts at position 0 (the kernel ropes
        new keys at their index in the cache; a window that has dropped blocks goes the torch way): q/k norms,
        rope, KV append and attention in one native call per sequence (instead of some thirty small torch ops).
        Only for one sequence, or sequences all decoding one token: a step with several prompts of a few tokens
        (or one beside decoding sequences) takes the general path, whose torch ops run once over all its rows, the
        decoding rows in one paged call and same-length prompts in one flash call. Per sequence here, each call
        gathered (and for int8 / int4 caches decoded) its whole cache: a job of 1,024 8-token prompts spent 45 s
        of its 79 s of steps in this path (docs/performance.md)."""
        segs = batch.segments
        if len(segs) > 1 and any(seg.length > 1 for seg in segs):
            return False
        return self._kernel_fits(x) and all(
            seg.length <= NATIVE_MAX_TOKENS and (self.window is None or seg.pos - self.window + 1 < BLOCK_TOKENS)
            for seg in segs)

    def _kernel_fits(self, x: torch.Tensor) -> bool:
        """The native attention kernels take this layer: no sinks, rotate-half rope over the whole head, no grad."""
        return (self.sinks is None and not self.rope.interleaved and not x.requires_grad and cpu.available()
                and self.rope.inv_freq.numel() * 2 == self.head_dim)

    def _attend_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, index: int) -> torch.Tensor:
        if self._paged(batch):
            return self._attend_paged(q, k, v, batch.segments, index)
        one = len(batch.segments) == 1
        out = None if one else torch.empty(q.shape[0], self.heads, self.head_dim)
        for seg in batch.segments:
            slot = self.slot(seg, index)
            r = seg.rows
            slot.k.push(k[r])
            slot.v.push(v[r])
            got = self._native_call(slot, q[r].contiguous(), seg.length)
            if one:
                return got
            out[r] = got
        return out

    def _paged(self, batch) -> bool:
        """Several sequences decoding one token each, no window: one paged native call for all of them."""
        segs = batch.segments
        return len(segs) >= PAGED_MIN_SEQUENCES and self.window is None and all(
            seg.length == 1 and seg.start == i for i, seg in enumerate(segs))

    def _attend_paged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments, index: int) -> torch.Tensor:
        """Segments decoding one token each, q / k / v their rows before q/k norm and rope: reserve each sequence's
        new row in its blocks; the kernel norms and ropes, writes the row and attends over the blocks in place."""
        slots = [self.slot(seg, index) for seg in segments]
        for slot in slots:
            slot.k.reserve(1)
            slot.v.reserve(1)
        return paged.gqa_decode_paged(q.contiguous(), k.contiguous(), v.contiguous(), [s.k.length for s in slots],
                                      [s.k.blocks for s in slots], [s.v.blocks for s in slots], self.scale,
                                      self.q_norm, self.k_norm, self.eps, self.rope.inv_freq,
                                      self.rope.attention_factor, slots[0].k.dtype, slots[0].k.block)

    def _native_call(self, slot: KVSlot, q: torch.Tensor, new: int) -> torch.Tensor:
        """The kernel wants the cache contiguous fp32: one fp32 block is passed as it is (the kernel norms and
        ropes the new keys in place); otherwise a gathered copy (charged while it exists) whose new, roped keys
        are written back to the blocks."""
        whole = [len(b.blocks) == 1 and b.dtype == torch.float32 for b in (slot.k, slot.v)]
        nbytes = 0 if all(whole) else slot.k.gather_bytes() + slot.v.gather_bytes()
        with scratch(slot.k.memory, nbytes, "gathered KV cache"):
            keys, values = slot.k.gather(), slot.v.gather()
            got = fused.gqa_attend(q, keys, values, new, self.scale, self.q_norm, self.k_norm, self.eps,
                                   self.rope.inv_freq, self.rope.attention_factor, self.window)
            if not whole[0]:
                slot.k.overwrite_tail(keys[keys.shape[0] - new:])
        return got
