"""Quantised dense weights: block-FP8 (DeepSeek-V3 / Kimi K2) and compressed-tensors int4 kept as stored bytes.

Owns `QuantWeight`, a tensor of the stored codes that carries its scales, and the two formats. `blocks.linear`
multiplies one through the chunked kernels of quant.py (a bounded slab of rows decoded to fp32 at a time, as for
experts), never through a whole fp32 copy; `rows` dequantises a row range exactly (MLA's one-time kv_b fold).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from moestream.kernels.quant import dequant_fp8_block, dequant_int4_packed, fp8_block_linear, int4_linear

# fp32 rows decoded per chunk by a dense quantised linear: 4 MiB (plus half that of int16 / uint8 work). Larger
# than the experts' L2-sized slab because a 16384-wide row fits only 24 rows in that, and each chunk costs a few
# Python-level torch calls; 128 rows of DeepSeek-V3's o_proj (one FP8 row block) are 8 MiB.
DENSE_CHUNK_BYTES = 8 << 20


def dense_rows_per_chunk(in_features: int) -> int:
    return max(1, DENSE_CHUNK_BYTES // (4 * in_features))


def dense_scratch_bytes(largest: int) -> int:
    """The most work bytes one quantised dense linear decodes into, for weights of at most `largest` elements:
    one chunk of fp32 rows and its integer codes (counted in the budget's scratch). Like any linear, the kernels
    also hold their output and one scaled copy of the input rows."""
    return min(DENSE_CHUNK_BYTES, 4 * largest) * 3 // 2


def matrix_shape(w: Tensor) -> tuple[int, ...]:
    """A weight's [out, in] shape: a QuantWeight's (its stored codes have another) or the tensor's own."""
    return (w.out_features, w.in_features) if isinstance(w, QuantWeight) else tuple(w.shape)


class QuantWeight(Tensor):
    """Stored codes as a plain-storage tensor plus scales. Torch ops on it see raw codes (no subclass propagation):
    reach values only through `linear`, `rows` or `float`."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    out_features: int
    in_features: int

    @property
    def codes(self) -> Tensor:
        return self.as_subclass(Tensor)

    def linear(self, x: Tensor) -> Tensor:
        """x [..., in] @ W^T as fp32 [..., out], decoding dense_rows_per_chunk rows at a time."""
        raise NotImplementedError

    def rows(self, start: int, stop: int) -> Tensor:
        """fp32 [stop - start, in] of the dequantised weight, exact."""
        raise NotImplementedError

    def float(self) -> Tensor:  # type: ignore[override]
        """The whole weight dequantised to fp32 (a full copy: tests and small weights only; use linear / rows)."""
        return self.rows(0, self.out_features)


class BlockFp8Weight(QuantWeight):
    """float8_e4m3fn codes with a per-(block[0] x block[1]) scale_inv (1 byte a weight in RAM, as stored)."""

    scale_inv: Tensor
    block: tuple[int, int]

    @staticmethod
    def wrap(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> "BlockFp8Weight":
        out = weight.as_subclass(BlockFp8Weight)
        out.scale_inv, out.block = scale_inv, tuple(block)
        out.out_features, out.in_features = weight.shape
        return out

    def linear(self, x: Tensor) -> Tensor:
        return fp8_block_linear(x, self.codes, self.scale_inv, self.block,
                                rows_per_chunk=dense_rows_per_chunk(self.in_features))

    def rows(self, start: int, stop: int) -> Tensor:
        b = self.block[0]
        first = start - start % b  # decode from the scale block's first row, keep the rows asked for
        rows = dequant_fp8_block(self.codes[first:stop], self.scale_inv[first // b:math.ceil(stop / b)], self.block)
        return rows[start - first:]


class Int4Weight(QuantWeight):
    """compressed-tensors pack-quantized int4: weight_packed int32 [out, in/8], per-group weight_scale."""

    scale: Tensor
    group: int

    @staticmethod
    def wrap(packed: Tensor, scale: Tensor, group: int, shape: Tensor | tuple[int, int] | None) -> "Int4Weight":
        out = packed.as_subclass(Int4Weight)
        out.scale, out.group = scale, group
        out.out_features = packed.shape[0]
        out.in_features = packed.shape[1] * 8 if shape is None else int(shape[1])
        return out

    def linear(self, x: Tensor) -> Tensor:
        return int4_linear(x, self.codes, self.scale, self.group, (self.out_features, self.in_features),
                           rows_per_chunk=dense_rows_per_chunk(self.codes.shape[1] * 8))

    def rows(self, start: int, stop: int) -> Tensor:
        return dequant_int4_packed(self.codes[start:stop], self.scale[start:stop], self.group,
                                   (stop - start, self.in_features))


def dense_float_rows(w: Tensor, start: int, stop: int) -> Tensor:
    """fp32 rows [start, stop) of any dense weight (plain or quantised), exact."""
    if isinstance(w, QuantWeight):
        return w.rows(start, stop)
    return w[start:stop].float()


def out_features(w: Tensor) -> int:
    return w.out_features if isinstance(w, QuantWeight) else w.shape[0]
