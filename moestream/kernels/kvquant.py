"""8-bit KV / latent cache rows (`--kv-dtype int8`): symmetric int8 in groups along a row's last dimension.

A stored row [*lead, D] keeps D int8 values and, per group of `group_of(D)` consecutive values, one fp32 scale
(the group's largest magnitude / 127): 1.0625 bytes an element for groups of 64, against bf16's 2, so a budget holds
about 1.9x the sequences of a bf16 cache. Values are rounded to nearest (ties to even), as torch.round and C's
nearbyintf do, so the native paged kernel (kernels/_cpu_paged.c) stores bit-identical rows. A group of zeros keeps
scale 0 and decodes to zeros. The block layout (memory/state.py BlockBuffer): a block's int8 values for all its rows
first, then its fp32 scales.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

GROUP = 64  # values per scale along the last dimension, where it divides it
QMAX = 127.0


def group_of(d: int) -> int:
    """Values per scale for rows whose last dimension is `d`: GROUP where it divides d, else the whole row."""
    return GROUP if d % GROUP == 0 else d


def row_bytes(row_shape: tuple[int, ...]) -> int:
    """Stored bytes of one row: its int8 values and one fp32 scale per group."""
    n = math.prod(row_shape)
    return n + 4 * (n // group_of(row_shape[-1]))


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (int8 [..., D], fp32 scales [..., D // group])."""
    d = x.shape[-1]
    g = group_of(d)
    xg = x.float().reshape(*x.shape[:-1], d // g, g)
    scale = xg.abs().amax(dim=-1) / QMAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(xg / safe.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(int8 [..., D], scales [..., D // group]) -> fp32 [..., D]."""
    d = q.shape[-1]
    g = group_of(d)
    return (q.reshape(*q.shape[:-1], d // g, g).float() * scale.unsqueeze(-1)).reshape(q.shape)


class Quantized(NamedTuple):
    """Rows quantised once (int8 values, fp32 scales) with the fp32 values they decode to, so that a step's rows for
    many sequences are quantised in one call and each sequence's cache takes its slice."""
    values: torch.Tensor
    scales: torch.Tensor
    decoded: torch.Tensor

    def rows(self, r) -> "Quantized":
        """The same rows' subset (any index along the first dimension)."""
        return Quantized(self.values[r], self.scales[r], self.decoded[r])


def quantized(x: torch.Tensor) -> Quantized:
    """x [..., D] -> its Quantized form (quantize, then dequantize once)."""
    q, s = quantize(x)
    return Quantized(q, s, dequantize(q, s))


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """The fp32 values an int8 cache gives back for x."""
    return dequantize(*quantize(x))
