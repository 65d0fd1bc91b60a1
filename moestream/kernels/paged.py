"""Paged GQA decode attention for a batch of sequences in one native call (`_cpu_paged.c`).

The caller (models/attention.py) has reserved each sequence's new row in its KV blocks; the kernel norms and ropes
the new query and key, writes key and value into those rows (fp32 or bf16 blocks, or int8 / int4 blocks with their
group scales, kernels/kvquant.py) and attends over each sequence's blocks in place: no per-sequence Python, no gathered
copy of a bf16 cache. Same values as `fused.gqa_attend` per
sequence, bit for bit (tests/test_paged_attention.py).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from moestream.kernels import kvquant
from moestream.kernels.cpu import _addresses, required
from moestream.kernels.fused import qk_prep

_STORAGE = {torch.float32: 0, torch.bfloat16: 1}  # block dtype -> the kernel's storage code
_QUANT_STORAGE = {8: 2, 4: 3}  # a quantised cache's bits -> the kernel's storage code (its blocks are uint8 slots)


def gqa_decode_paged(q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int], kblocks: Sequence[Sequence[Tensor]],
                     vblocks: Sequence[Sequence[Tensor]], scale: float, q_norm: Tensor | None = None,
                     k_norm: Tensor | None = None, eps: float = 1e-6, inv_freq: Tensor | None = None,
                     factor: float = 1.0, storage: torch.dtype | None = None, block: int | None = None) -> Tensor:
    """B sequences decoding one token each: q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, Dv] fp32 contiguous (q is
    normed and roped in place). Sequence s holds lengths[s] rows including this token, in its blocks kblocks[s] /
    vblocks[s] (each [block, Hkv, D|Dv], all of one dtype, fp32 or bf16; the row lengths[s] - 1 is written here).
    With storage torch.int8 or kvquant.INT4 the blocks are BlockBuffer's quantised slots (uint8 [>= block x row
    bytes]: fp32 group scales, then int8 or packed int4 values) and `block` says their rows. Returns out [B, Hq, Dv]
    fp32."""
    handle = required()
    b, hq, d = q.shape
    hkv, dv = v.shape[1], v.shape[2]
    for name, m in (("q", q), ("k", k), ("v", v)):
        if m.dtype != torch.float32 or not m.is_contiguous() or m.shape[0] != b:
            raise ValueError(f"gqa_decode_paged wants contiguous fp32 {name} with {b} rows")
    if k.shape != (b, hkv, d) or hq % hkv or len(lengths) != b or len(kblocks) != b or len(vblocks) != b:
        raise ValueError(f"gqa_decode_paged: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"{len(lengths)} lengths")
    first = kblocks[0][0]
    bits = kvquant.bits_of(storage) if storage is not None else 0
    if bits:
        code = _QUANT_STORAGE[bits]
        if block is None or first.dtype != torch.uint8 or first.dim() != 1 \
                or first.numel() < block * kvquant.row_bytes((hkv, d), bits) \
                or vblocks[0][0].numel() < block * kvquant.row_bytes((hkv, dv), bits):
            raise ValueError(f"gqa_decode_paged wants int{bits} slots of {block} rows [{hkv}, {d}|{dv}]")
    else:
        block, code = first.shape[0], _STORAGE.get(first.dtype)
        if code is None or first.shape[1:] != (hkv, d) or vblocks[0][0].shape[1:] != (hkv, dv) \
                or vblocks[0][0].dtype != first.dtype:
            raise ValueError(f"gqa_decode_paged wants fp32 or bf16 blocks [block, {hkv}, {d}|{dv}]")
    offsets, kptrs, vptrs = [], [], []
    for n, ks, vs in zip(lengths, kblocks, vblocks):
        if not 0 < n <= block * min(len(ks), len(vs)) or ks[0].dtype != first.dtype or vs[0].dtype != first.dtype:
            raise ValueError(f"gqa_decode_paged: {n} rows do not fit {len(ks)} blocks of {block} {first.dtype}")
        offsets.append(len(kptrs))
        kptrs += [t.data_ptr() for t in ks[:len(vs)]]
        vptrs += [t.data_ptr() for t in vs[:len(ks)]]
    qn, kn, nbf16, freq = qk_prep("gqa_decode_paged", d, q_norm, k_norm, inv_freq)
    out = torch.empty(b, hq, dv, dtype=torch.float32)
    if handle.ms_gqa_decode_paged(b, hq, hkv, d, dv, q.data_ptr(), k.data_ptr(), v.data_ptr(), _addresses(lengths),
                                  _addresses(offsets), _addresses(kptrs), _addresses(vptrs), block, code,
                                  kvquant.group_of(d), kvquant.group_of(dv), qn, kn,
                                  nbf16, eps, freq, factor, scale, out.data_ptr()):
        raise MemoryError("native paged attention could not allocate its scores")
    return out
