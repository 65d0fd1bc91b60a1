"""Softmax attention over key tiles with an online softmax: never a whole [heads, queries, keys] score matrix.

Owns `tiled_attention` (dense q, k, v with GQA grouping, causal offsets, an optional sliding window and per-head
sinks), `attend_tiles` (the same over any ordered source of key tiles, e.g. a KV cache's blocks) and `tile_plan`,
the tile sizes that fit a scratch budget and what they allocate besides the output. GQA (attention.py) and MLA
(mla.py) prefill both use it; running max, sum and accumulator are fp32.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

KEY_TILE = 512  # keys per tile at most
MIN_KEY_TILE = 16  # a tight scratch budget shrinks key tiles down to this before it is exceeded
TILE_BYTES = 4 << 20  # default scratch budget of one call (query rows shrink to fit it)

Tiles = Callable[[], Iterable[tuple[int, torch.Tensor, torch.Tensor]]]  # fresh iterator of (first key pos, k, v)


def tile_plan(batch_heads: int, kv_heads: int, tq: int, tk: int, d: int, dv: int,
              budget: int = TILE_BYTES) -> tuple[int, int, int]:
    """(query rows, keys, scratch bytes) of one tile. Scratch besides the [.., Tq, Dv] output: per key tile its
    fp32 keys and values (merged from blocks, then converted: two copies); per query row and key the fp32 score
    (probabilities in place) and the mask byte; per query row the query copy, accumulator and its update, and four
    running scalars. The most query rows (then keys, down to MIN_KEY_TILE) that fit `budget`; one row of the
    smallest tile when nothing fits (its bytes are then over the budget and the caller charges the excess)."""
    kt = max(1, min(tk, KEY_TILE))
    while True:
        per_tile = 8 * kv_heads * kt * (d + dv)
        per_row = 4 * batch_heads * kt + kt + 4 * batch_heads * (d + 2 * dv + 4)
        qt = min(tq, (budget - per_tile) // per_row)
        if qt >= 1 or kt <= MIN_KEY_TILE:
            qt = max(1, qt)
            return qt, kt, per_tile + qt * per_row
        kt = max(MIN_KEY_TILE, kt // 2)


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos: int = 0, k_pos: int = 0,
                    window: int | None = None, sinks: torch.Tensor | None = None,
                    budget: int = TILE_BYTES) -> torch.Tensor:
    """Causal softmax attention. q [..., Hq, Tq, D], k [..., Hkv, Tk, D], v [..., Hkv, Tk, Dv] (Hq a multiple of
    Hkv: query head h uses KV head h // (Hq / Hkv)); query i sits at position q_pos + i, key j at k_pos + j, and
    sees keys at positions <= its own (and > its own - window with a window). sinks [Hq]: a per-head logit that
    joins each softmax's denominator only (gpt-oss). Tiles fit `budget` bytes of scratch (tile_plan). Returns
    fp32 [..., Hq, Tq, Dv]."""
    lead = q.shape[:-3]
    hq, tq, d = q.shape[-3:]
    hkv, tk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    qf = q.reshape(-1, hq, tq, d)
    kf, vf = k.reshape(-1, hkv, tk, d), v.reshape(-1, hkv, tk, dv)
    qt, kt, _ = tile_plan(qf.shape[0] * hq, qf.shape[0] * hkv, tq, tk, d, dv, budget)

    def tiles():
        for s in range(0, tk, kt):
            yield k_pos + s, kf[:, :, s:s + kt], vf[:, :, s:s + kt]

    return attend_tiles(qf, tiles, q_pos, scale, window, sinks, qt, dv).reshape(*lead, hq, tq, dv)


def attend_tiles(q: torch.Tensor, tiles: Tiles, q_pos: int, scale: float, window: int | None, sinks: torch.Tensor | None,
                 rows: int, dv: int) -> torch.Tensor:
    """q [B, Hq, Tq, D] over key tiles (first key position, k [B, Hkv, n, D], v [B, Hkv, n, Dv]) in increasing
    position order, `rows` queries at a time (`tiles()` is called once per block of them). Same semantics as
    tiled_attention; returns fp32 [B, Hq, Tq, Dv]."""
    b, hq, tq, _ = q.shape
    out = torch.empty(b, hq, tq, dv)
    for s in range(0, tq, rows):
        out[:, :, s:s + rows] = _query_block(q[:, :, s:s + rows].float(), tiles, q_pos + s, scale, window, sinks)
    return out


def _query_block(q: torch.Tensor, tiles: Tiles, q_pos: int, scale: float, window: int | None,
                 sinks: torch.Tensor | None) -> torch.Tensor:
    """One block of query rows [B, Hq, n, D] (positions q_pos ..) through every key tile it can see."""
    b, hq, n, d = q.shape
    qpos = torch.arange(q_pos, q_pos + n).unsqueeze(1)  # [n, 1]
    acc = m = l = qg = None
    for k_first, k, v in tiles():
        if k_first > q_pos + n - 1:
            break  # this and later tiles are in every query's future
        nk, hkv = k.shape[2], k.shape[1]
        if window is not None and k_first + nk - 1 <= q_pos - window:
            continue  # wholly before every query's window
        g = hq // hkv
        if qg is None:
            qg = q.reshape(b * hkv, g * n, d)  # rows (group, query) of each KV head
        scores = torch.bmm(qg, k.float().reshape(b * hkv, nk, d).transpose(1, 2)).mul_(scale)
        scores = scores.view(b, hq, n, nk)
        kpos = torch.arange(k_first, k_first + nk).unsqueeze(0)  # [1, nk]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        if not bool(allowed.all()):
            scores.masked_fill_(~allowed, float("-inf"))
        if m is None:
            m, l, acc = _start(b, hq, n, v.shape[-1], sinks)
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows that have seen nothing yet
        probs = scores.sub_(m_safe).exp_()
        corr = (m - m_safe).exp_()
        l = l.mul_(corr).add_(probs.sum(-1, keepdim=True))
        pv = torch.bmm(probs.view(b * hkv, g * n, nk), v.float().reshape(b * hkv, nk, -1))
        acc = acc.mul_(corr).add_(pv.view(b, hq, n, -1))
        m = m_new
    if acc is None:
        raise ValueError(f"attention: no key at or before query positions {q_pos}..{q_pos + n - 1}")
    return torch.where(l > 0, acc / l.clamp_min(1e-38), torch.zeros(()))  # a query that saw no key (and no sink): 0


def _start(b: int, hq: int, n: int, dv: int, sinks: torch.Tensor | None):
    """Running max, sum and accumulator before the first tile: a sink counts as one more logit already seen."""
    acc = torch.zeros(b, hq, n, dv)
    if sinks is None:
        return torch.full((b, hq, n, 1), float("-inf")), torch.zeros(b, hq, n, 1), acc
    m = sinks.float().view(1, hq, 1, 1).expand(b, hq, n, 1).clone()
    return m, torch.ones(b, hq, n, 1), acc
