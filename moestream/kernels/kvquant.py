"""Quantised KV / latent cache rows (`--kv-dtype int8`, `--kv-dtype int4`): symmetric integers in groups along a
row's last dimension, one fp32 scale per group.

A stored row [*lead, D] keeps D integer values and, per group of `group_of(D)` consecutive values, one fp32 scale
(the group's largest magnitude / QMAX: 127 for 8 bits, 7 for 4 bits). int8 takes a byte a value: 1.0625 bytes an
element for groups of 64, against bf16's 2, so a budget holds about 1.9x the sequences of a bf16 cache. int4 packs
two values a byte (0.5625 bytes an element, 0.53 of int8's): element 2j in the low nibble of byte j, element 2j + 1
in the high one, each stored as value + 8 (codes 1..15; the range is the symmetric [-7, 7], code 0 is never
written), so D must be even. Values are rounded to nearest (ties to even), as torch.round and C's nearbyintf do, and
clamped to [-QMAX, QMAX], so the native paged kernel (kernels/_cpu_paged.c) stores bit-identical rows. A group of
zeros keeps scale 0 and decodes to zeros. The block layout (memory/state.py BlockBuffer): a block's fp32 scales for
all its rows first, then its values (int8, or the packed int4 bytes), so the scales are aligned whatever the width.

Quantised storage is named by a torch dtype tag, as fp32 and bf16 caches are by theirs: torch.int8 for int8 and
INT4 (torch.quint4x2, the 4-bit-pairs-in-a-byte dtype) for int4; no quint4x2 tensor is ever made, the blocks are
uint8 slots.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from moestream.errors import MoestreamError
from moestream.kernels import cpu

GROUP = 64  # values per scale along the last dimension, where it divides it
INT4 = torch.quint4x2  # the tag of --kv-dtype int4 storage
BITS = {torch.int8: 8, INT4: 4}  # quantised storage tag -> bits a value
QMAX = 127.0  # int8's largest code (kept under its old name)
QMAXES = {8: QMAX, 4: 7.0}
NATIVE_QMAXES = {8: 127.0, 4: 7.0}  # the C kernels' own constants (`quantize_row`): they serve where QMAXES agrees


def bits_of(dtype: torch.dtype) -> int:
    """Bits a value of this cache storage when it is quantised (8 or 4), 0 for fp32 / bf16."""
    return BITS.get(dtype, 0)


def group_of(d: int) -> int:
    """Values per scale for rows whose last dimension is `d`: GROUP where it divides d, else the whole row."""
    return GROUP if d % GROUP == 0 else d


def value_bytes(row_shape: tuple[int, ...], bits: int = 8) -> int:
    """Bytes of one row's values: one a value for int8, one per two values for int4 (an odd last dimension is
    refused: the nibble pairs run along it)."""
    n = math.prod(row_shape)
    if bits == 8:
        return n
    if bits != 4:
        raise ValueError(f"kvquant: {bits}-bit rows are not supported (8 or 4)")
    if row_shape[-1] % 2:
        raise MoestreamError(f"--kv-dtype int4 packs two values a byte along a row; rows of width {row_shape[-1]} "
                             "(odd) cannot be stored: use --kv-dtype int8")
    return n // 2


def scale_bytes(row_shape: tuple[int, ...]) -> int:
    """Bytes of one row's scales: one fp32 per group."""
    return 4 * (math.prod(row_shape) // group_of(row_shape[-1]))


def row_bytes(row_shape: tuple[int, ...], bits: int = 8) -> int:
    """Stored bytes of one row: its values and one fp32 scale per group."""
    return value_bytes(row_shape, bits) + scale_bytes(row_shape)


def pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., D] in [-7, 7] (D even) -> uint8 [..., D / 2]: element 2j + 8 in the low nibble of byte j,
    element 2j + 1 + 8 in the high one."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 2] -> int8 codes [..., D] (pack4's inverse)."""
    lo = (p & 0x0F).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def quantize(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (values, fp32 scales [..., D // group]); values int8 [..., D] for 8 bits,
    packed uint8 [..., D / 2] for 4 bits."""
    d = x.shape[-1]
    g = group_of(d)
    qmax = QMAXES[bits]
    if bits == 4:
        value_bytes(tuple(x.shape[-1:]), 4)  # the odd-width refusal
    xg = x.float().reshape(*x.shape[:-1], d // g, g)
    scale = xg.abs().amax(dim=-1) / qmax
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(xg / safe.unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8).reshape(x.shape)
    return (pack4(q) if bits == 4 else q), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """(values as `quantize` gives them, scales [..., D // group]) -> fp32 [..., D]."""
    if bits == 4:
        q = unpack4(q)
    d = q.shape[-1]
    g = group_of(d)
    return (q.reshape(*q.shape[:-1], d // g, g).float() * scale.unsqueeze(-1)).reshape(q.shape)


class Quantized(NamedTuple):
    """Rows quantised once (values, fp32 scales) with the fp32 values they decode to, so that a step's rows for
    many sequences are quantised in one call and each sequence's cache takes its slice."""
    values: torch.Tensor
    scales: torch.Tensor
    decoded: torch.Tensor

    def rows(self, r) -> "Quantized":
        """The same rows' subset (any index along the first dimension)."""
        return Quantized(self.values[r], self.scales[r], self.decoded[r])


def quantized(x: torch.Tensor, bits: int = 8) -> Quantized:
    """x [..., D] -> its Quantized form (quantize, then dequantize once). An fp32 x goes through one native pass
    where the kernels are built (`ms_kv_quantize`, the same bits as the torch ops: a 2,048-token prefill chunk's keys
    or values took ~11 ms of some ten torch ops a layer)."""
    d = x.shape[-1]
    if (x.dtype != torch.float32 or x.requires_grad or x.numel() == 0 or QMAXES.get(bits) != NATIVE_QMAXES.get(bits)
            or not cpu.available()):
        q, s = quantize(x, bits)
        return Quantized(q, s, dequantize(q, s, bits))
    g = group_of(d)
    value_bytes(tuple(x.shape[-1:]), bits)  # the odd-width refusal (int4), and an unknown width
    x = x.contiguous()
    lead = x.shape[:-1]
    values = torch.empty(*lead, d if bits == 8 else d // 2, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales, decoded = torch.empty(*lead, d // g), torch.empty_like(x)
    cpu.required().ms_kv_quantize(x.data_ptr(), x.numel() // d, d, 2 if bits == 8 else 3, g, values.data_ptr(),
                                  scales.data_ptr(), decoded.data_ptr())
    return Quantized(values, scales, decoded)


def roundtrip(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The fp32 values a cache of `bits`-bit rows gives back for x."""
    return dequantize(*quantize(x, bits), bits)
