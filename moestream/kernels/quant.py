"""Weight-format kernels: MXFP4 (E2M1 + E8M0), DeepSeek block FP8 and compressed-tensors int4 pack-quantized.

Owns the bit layouts (nibble order, scale encodings, int4 offset packing), exact float32 dequantisation
references, chunked `*_linear` kernels that compute x @ W^T from the packed bytes through a small reused fp32
scratch buffer, the quantisers used by tests and synthetic checkpoint writers, and a memory bandwidth probe.
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from moestream.errors import CheckpointError
from moestream.kernels import cpu

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)
MXFP4_BLOCK = 32
FP8_BLOCK = (128, 128)
# fewer rows than this take the native FP8 kernel; more are matmuls over decoded chunks, whose decode the rows share
# (DeepSeek-V3's shapes, 2 threads, from DRAM: native 80-101 GFLOP/s at 16-64 rows against torch's 36-95, torch
# ahead from 128 rows: 98-127 against 82-91; docs/performance.md)
FP8_NATIVE_MAX_T = 64
# the same for int4 (group 32): native 80-97 GFLOP/s at 16-128 rows of Kimi K2's expert shapes against torch's
# 18-89 (docs/performance.md)
INT4_NATIVE_MAX_T = 128
# fp32 scratch per *_linear call: 96..146 rows of 3584 (1.3..2 MiB) time the same, 192+ rows are slower
# (bench/kernels.py --chunks, 1 MiB L2 per core)
SCRATCH_BYTES = 3 << 19

_F16_SHIFT = 14  # MXFP4 codes decode to E2M1 * 2^-14 as fp16 bit patterns (see _mxfp4_decode)
_F16_MAX_SCALE = 254 - _F16_SHIFT  # largest scale byte whose 2^(s - 127 + 14) is finite in fp32
_E2M1_MASK = -29184  # 0x8E00 as int16: fp16 sign bit + the two low exponent bits + top mantissa bit
_E4M3_MASK = -16512  # 0xBF80 as int16: fp16 sign bit + low four exponent bits + top three mantissa bits
# low nibble to bits 15..12 (x4096, wrapping), high nibble to bits 15..12 (x256: the low nibble then sits in
# bits 11..8 and is shifted into bits that _E2M1_MASK clears)
_NIBBLE_LIFT = torch.tensor([4096, 256], dtype=torch.int16).view(1, 2, 1)
_E4M3_LIFT = torch.tensor([128], dtype=torch.int16)  # sign-extended int8 -> int16, << 7


# ---------------------------------------------------------------------------------------------------- helpers


def e8m0_to_float(scales: Tensor, shift: int = 0) -> Tensor:
    """2^(s - 127 + shift) as float32 for each scale byte s, exact (2^-127 is a subnormal; past 2^127 is inf)."""
    exponent = scales.to(torch.int64) + (shift - 127 + 1023)
    return (exponent << 52).view(torch.float64).to(torch.float32)


def _rows_per_chunk(rows_per_chunk: int | None, in_features: int, scratch: Tensor | None) -> int:
    rows = rows_per_chunk or max(1, SCRATCH_BYTES // (4 * in_features))
    if scratch is not None:
        if scratch.dtype != torch.float32 or not scratch.is_contiguous():
            raise ValueError("scratch must be a contiguous float32 tensor")
        rows = min(rows, scratch.numel() // in_features)
        if rows < 1:
            raise ValueError(f"scratch holds {scratch.numel()} floats, less than one row of {in_features}")
    return rows


def _scratch_rows(scratch: Tensor | None, rows: int, in_features: int) -> Tensor:
    if scratch is None:
        return torch.empty(rows, in_features, dtype=torch.float32)
    return scratch.view(-1)[: rows * in_features].view(rows, in_features)


# ---------------------------------------------------------------------------------------------------- MXFP4


def _mxfp4_operands(packed: Tensor, scales: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """Validate and flatten to packed [out, in/2] and scales [out, in/32] (gpt-oss blocks are [out, in/32, 16])."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 tensor {name or '<unnamed>'}: expected uint8 blocks and scales, "
                              f"got {packed.dtype} and {scales.dtype}")
    if packed.dim() == 3:
        packed = packed.reshape(packed.shape[0], -1)
    if packed.dim() != 2 or scales.dim() != 2 or scales.shape[0] != packed.shape[0] \
            or packed.shape[1] != scales.shape[1] * (MXFP4_BLOCK // 2):
        raise CheckpointError(f"MXFP4 tensor {name or '<unnamed>'}: packed {tuple(packed.shape)} does not match "
                              f"scales {tuple(scales.shape)} (want [out, in/2] and [out, in/32])")
    return packed.contiguous(), scales.contiguous()


def _check_scales(scales: Tensor, name: str) -> None:
    bad = scales == 255
    if bool(bad.any()):
        row, block = (int(v) for v in bad.nonzero()[0])
        raise CheckpointError(
            f"MXFP4 tensor {name or '<unnamed>'}: scale byte 0xFF (NaN in E8M0) at row {row}, block {block} "
            f"(inputs {block * MXFP4_BLOCK}..{block * MXFP4_BLOCK + MXFP4_BLOCK - 1}); the checkpoint is corrupt, "
            "re-download the shard that holds it")


def _check_layout(layout: str) -> None:
    if layout not in ("low_first", "gguf"):
        raise ValueError(f"unknown MXFP4 layout {layout!r}: use 'low_first' (compressed-tensors, gpt-oss) or 'gguf'")


def dequant_mxfp4(packed: Tensor, scales: Tensor, layout: str = "low_first", name: str = "") -> Tensor:
    """Expand MXFP4 to float32 [out, in], exactly (a plain table lookup: the reference for the fast kernels).

    layout "low_first": byte j holds element 2j (low nibble) and 2j+1 (high nibble); "gguf": within each
    block of 32, byte j holds element j (low nibble) and j+16 (high nibble). A scale byte 0xFF raises.
    """
    _check_layout(layout)
    packed, scales = _mxfp4_operands(packed, scales, name)
    _check_scales(scales, name)
    rows = packed.shape[0]
    low = E2M1_VALUES[(packed & 0x0F).long()]
    high = E2M1_VALUES[(packed >> 4).long()]
    if layout == "low_first":
        values = torch.stack((low, high), dim=-1)
    else:
        values = torch.stack((low.view(rows, -1, 16), high.view(rows, -1, 16)), dim=2)
    values = values.reshape(rows, -1, MXFP4_BLOCK) * e8m0_to_float(scales).unsqueeze(-1)
    return values.reshape(rows, -1)


def _mxfp4_decode(packed: Tensor, mult: Tensor, bits: Tensor, out: Tensor) -> None:
    """Decode packed rows [n, in/2] into out [n, 2, in/2] (all low nibbles, then all high) times mult [n, nb].

    Each nibble s|e1 e0|m is moved to fp16 bits s..|e1 e0|m.. (sign to bit 15 by an arithmetic shift), which
    reads as E2M1 * 2^-14 including the 0.5 subnormal; mult = 2^(scale - 127 + 14) restores the value.
    Two half planes (not [block, 2, 16]) because the widening multiply is ~10x faster on long rows.
    """
    n, half = packed.shape
    torch.mul(packed.view(n, 1, half), _NIBBLE_LIFT, out=bits.view(n, 2, half))
    bits.bitwise_right_shift_(3).bitwise_and_(_E2M1_MASK)
    torch.mul(bits.view(torch.float16).view(n, 2, -1, 16), mult.view(n, 1, -1, 1), out=out.view(n, 2, -1, 16))


def _mxfp4_permute_x(x: Tensor, layout: str) -> Tensor:
    """Reorder x's inputs to _mxfp4_decode's column order: [even-or-first-16 inputs, odd-or-last-16 inputs]."""
    tokens, in_features = x.shape
    if layout == "gguf":  # block b's low nibbles are inputs 32b..32b+15, its high nibbles 32b+16..32b+31
        return x.view(tokens, -1, 2, 16).transpose(1, 2).reshape(tokens, in_features)
    return x.view(tokens, -1, 2).transpose(1, 2).reshape(tokens, in_features)


def bf16_rounded(x: Tensor) -> Tensor:
    """x rounded to bf16 (nearest even), as float32: what the bf16 compute path multiplies."""
    return x.to(torch.bfloat16).float()


def mxfp4_native(tokens: int) -> bool:
    """Whether mxfp4_linear takes the native kernel (moestream.kernels.cpu) for `tokens` activation rows."""
    return tokens <= cpu.MAX_TOKENS_MXFP4 and cpu.available()


def check_mxfp4_scales(scales: Tensor, name: str = "") -> None:
    """Raise the 0xFF scale error (see _check_scales); a memchr when the native library is loaded."""
    if cpu.available() and scales.is_contiguous():
        if cpu.find_byte(scales, 255) >= 0:
            _check_scales(scales, name)
    else:
        _check_scales(scales, name)


def mxfp4_linear(x: Tensor, packed: Tensor, scales: Tensor, scratch: Tensor | None = None,
                 rows_per_chunk: int | None = None, layout: str = "low_first", name: str = "",
                 native: bool = True, bf16: bool = False) -> Tensor:
    """y = x @ W^T for MXFP4 W (float32 [..., out]).

    Up to cpu.MAX_TOKENS_MXFP4 rows the native kernel decodes in registers (when available and `native`);
    otherwise rows_per_chunk rows at a time are decoded into an fp32 scratch and multiplied by torch.mm
    (rows_per_chunk None fits the chunk in SCRATCH_BYTES, or in `scratch`, a reusable flat float32 buffer).
    Equal to x @ dequant_mxfp4(packed, scales).T up to fp32 summation order; with `bf16` (the bf16 compute
    path), to bf16(x) @ dequant_mxfp4(packed, scales).T.
    """
    _check_layout(layout)
    packed, scales = _mxfp4_operands(packed, scales, name)
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    lead = x.shape[:-1]
    x2 = cpu.rows(x, in_features)
    if native and mxfp4_native(x2.shape[0]):
        if scratch is not None:
            _rows_per_chunk(rows_per_chunk, in_features, scratch)  # a bad scratch fails either way
        check_mxfp4_scales(scales, name)  # before the call: the kernel assumes no 0xFF byte
        return cpu.linear_mxfp4(x2, packed, scales, layout, bf16=bf16).view(*lead, out_features)
    xp = _mxfp4_permute_x(bf16_rounded(x2) if bf16 else x2, layout)
    mult, rescale = _mxfp4_multipliers(scales, name)
    rows = _rows_per_chunk(rows_per_chunk, in_features, scratch)
    buf = _scratch_rows(scratch, rows, in_features)
    bits = torch.empty(rows, in_features, dtype=torch.int16)
    out = torch.empty(xp.shape[0], out_features, dtype=torch.float32)
    for r in range(0, out_features, rows):
        n = min(rows, out_features - r)
        w = buf[:n]
        _mxfp4_decode(packed[r:r + n], mult[r:r + n], bits[:n], w)
        if rescale:
            w.mul_(2.0 ** _F16_SHIFT)
        torch.mm(xp, w.T, out=out[:, r:r + n])
    return out.view(*lead, out_features)


GROUP_DECODE_BYTES = 4 << 20  # fp32 scratch for decoding several resident experts at once (counted in the budget)


def mxfp4_decode_planes(packed: Tensor, scales: Tensor, name: str = "") -> Tensor:
    """fp32 [out, in] of a compressed-tensors MXFP4 weight, its columns in the fast kernel's half-plane order:
    multiply by `mxfp4_permute_input(x)`. Exact; used to decode several experts with one call."""
    mult, rescale = _mxfp4_multipliers(scales, name)
    n, half = packed.shape
    out = torch.empty(n, 2 * half, dtype=torch.float32)
    _mxfp4_decode(packed, mult, torch.empty(n, 2 * half, dtype=torch.int16), out)
    if rescale:
        out.mul_(2.0 ** _F16_SHIFT)
    return out


def mxfp4_permute_input(x: Tensor) -> Tensor:
    """x [T, in] reordered to match `mxfp4_decode_planes` columns."""
    return _mxfp4_permute_x(x, "low_first")


def _mxfp4_multipliers(scales: Tensor, name: str) -> tuple[Tensor, bool]:
    """Per-block multipliers for _mxfp4_decode's fp16 values: 2^(s - 127 + 14), built from fp32 exponent bits.

    Where a scale byte above 240 would overflow that, returns 2^(s - 127) and rescale=True (then x 2^14).
    """
    top = int(scales.max()) if scales.numel() else 0
    if top == 255:
        _check_scales(scales, name)
    if top > _F16_MAX_SCALE:
        return e8m0_to_float(scales), True
    return (torch.add(scales, _F16_SHIFT).to(torch.int32) << 23).view(torch.float32), False


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """float32 [out, in] -> (packed uint8 [out, in/2], scales uint8 [out, in/32]), compressed-tensors order.

    Each block of 32 gets the smallest power-of-two scale 2^e with max|w| <= 6 * 2^e; elements round to the
    nearest E2M1 value (ties to the even code). Values already representable round-trip exactly.
    """
    rows, cols = w.shape
    if cols % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of 32, got {cols}")
    blocks = w.to(torch.float32).reshape(rows, -1, MXFP4_BLOCK)
    exponent = _mxfp4_exponents(blocks.abs().amax(-1))
    scaled = blocks * e8m0_to_float(127 - exponent).unsqueeze(-1)
    codes = _nearest_e2m1(scaled).reshape(rows, -1, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def _mxfp4_exponents(amax: Tensor) -> Tensor:
    """Smallest integer e with amax <= 6 * 2^e, clamped to the E8M0 range (all-zero blocks get e = 0)."""
    amax = amax.to(torch.float64)
    nonzero = amax > 0
    e = torch.where(nonzero, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax))
    e = e + (amax > 6.0 * torch.exp2(e)).double()  # log2 rounding, either way
    e = e - ((amax <= 6.0 * torch.exp2(e - 1)) & nonzero).double()
    return e.clamp(-127, 127).to(torch.int32)


def _nearest_e2m1(values: Tensor) -> Tensor:
    """Code (int64, 0..15) of the E2M1 value nearest each element of values (|values| <= 6 after scaling)."""
    grid = E2M1_VALUES[:8]
    mag = values.abs().clamp(max=6.0)
    below = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, 7)
    above = (below + 1).clamp(max=7)
    gap_below, gap_above = mag - grid[below], grid[above] - mag
    take_above = (gap_above < gap_below) | ((gap_above == gap_below) & (above % 2 == 0) & (above != below))
    code = torch.where(take_above, above, below)
    return code | ((values < 0).long() << 3)


# ---------------------------------------------------------------------------------------------------- FP8 block


def _fp8_check(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> None:
    rows, cols = weight.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if weight.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != want:
        raise CheckpointError(f"block-FP8 weight {tuple(weight.shape)} {weight.dtype} needs float8_e4m3fn and "
                              f"scale_inv of shape {want}, got {tuple(scale_inv.shape)}")


def _block_scales(scale_inv: Tensor, block: tuple[int, int], shape: tuple[int, int]) -> Tensor:
    grid = scale_inv.to(torch.float32).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return grid[: shape[0], : shape[1]]


def dequant_fp8_block(weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = FP8_BLOCK) -> Tensor:
    """float8_e4m3fn [out, in] times its per-block scale_inv [ceil(out/128), ceil(in/128)], as float32."""
    _fp8_check(weight, scale_inv, block)
    return weight.to(torch.float32) * _block_scales(scale_inv, block, tuple(weight.shape))


def _fp8_decode(weight: Tensor, bits: Tensor, out: Tensor) -> None:
    """float8_e4m3fn rows -> out as e4m3 * 2^-8 (fp16 bit patterns, so subnormals are exact).

    NaN codes (0x7F, 0xFF) decode as +-480 here rather than NaN.
    """
    torch.mul(weight.view(torch.int8), _E4M3_LIFT, out=bits)
    bits.bitwise_and_(_E4M3_MASK)
    out.copy_(bits.view(torch.float16))


def fp8_native(tokens: int, in_features: int, block: tuple[int, int] = FP8_BLOCK) -> bool:
    """Whether fp8_block_linear takes the native kernel for `tokens` rows: fewer than FP8_NATIVE_MAX_T, AVX-512,
    the width and the column block multiples of 64 (DeepSeek-V3 / Kimi K2's every block-FP8 weight)."""
    return (tokens < FP8_NATIVE_MAX_T and in_features % 64 == 0 and block[1] % 64 == 0 and cpu.available()
            and cpu.simd() == "avx512")


def fp8_block_linear(x: Tensor, weight: Tensor, scale_inv: Tensor, block: tuple[int, int] = FP8_BLOCK,
                     scratch: Tensor | None = None, rows_per_chunk: int | None = None,
                     native: bool = True) -> Tensor:
    """y = x @ W^T for block-FP8 W (float32 [..., out]).

    Fewer than FP8_NATIVE_MAX_T rows (decode steps, short prompts, experts of few rows) go to the native kernel
    where fp8_native says so: the codes read as stored, each column block's products summed and scaled
    (kernels/_cpu_fp8.c), no work memory. Otherwise chunk by chunk, the per-block scale folded into x: one chunk
    of rows as fp32 (`scratch`, or rows_per_chunk / SCRATCH_BYTES) and int16, and one scaled copy of x; never a
    whole fp32 weight. The two differ by fp32 rounding only."""
    _fp8_check(weight, scale_inv, block)
    out_features, in_features = weight.shape
    lead = x.shape[:-1]
    x2 = cpu.rows(x, in_features)
    if native and fp8_native(x2.shape[0], in_features, block) and weight.is_contiguous():
        return cpu.linear_fp8(x2, weight, scale_inv, block).view(*lead, out_features)
    rows = min(_rows_per_chunk(rows_per_chunk, in_features, scratch), block[0])
    buf = _scratch_rows(scratch, rows, in_features)
    bits = torch.empty(rows, in_features, dtype=torch.int16)
    xs = torch.empty_like(x2)  # x times one row block's column scales, reused block after block
    out = torch.empty(x2.shape[0], out_features, dtype=torch.float32)
    for row_block in range(scale_inv.shape[0]):
        col_scales = scale_inv[row_block].to(torch.float32).repeat_interleave(block[1])[:in_features]
        torch.mul(x2, col_scales, out=xs)
        stop = min(out_features, (row_block + 1) * block[0])
        for r in range(row_block * block[0], stop, rows):
            n = min(rows, stop - r)
            _fp8_decode(weight[r:r + n], bits[:n], buf[:n])
            torch.mm(xs, buf[:n].T, out=out[:, r:r + n])
    return out.mul_(256.0).view(*lead, out_features)


def quantize_fp8_block(w: Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """float32 [out, in] -> (float8_e4m3fn weight, float32 scale_inv per block), block max mapped to 448."""
    rows, cols = w.shape
    w = w.to(torch.float32)
    padded = torch.zeros(math.ceil(rows / block[0]) * block[0], math.ceil(cols / block[1]) * block[1])
    padded[:rows, :cols] = w
    tiles = padded.view(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (w / _block_scales(scale_inv, block, (rows, cols))).clamp(-448.0, 448.0)
    return q.to(torch.float8_e4m3fn), scale_inv


# ---------------------------------------------------------------------------------------------------- int4


def _int4_check(packed: Tensor, scale: Tensor, group_size: int) -> None:
    if packed.dtype != torch.int32 or packed.dim() != 2 or scale.dim() != 2 or scale.shape[0] != packed.shape[0]:
        raise CheckpointError(f"int4 pack-quantized weight needs weight_packed int32 [out, in/8] and weight_scale "
                              f"[out, in/{group_size}], got {tuple(packed.shape)} {packed.dtype} and "
                              f"{tuple(scale.shape)}")
    if scale.shape[1] != math.ceil(packed.shape[1] * 8 / group_size):
        raise CheckpointError(f"int4 weight_scale {tuple(scale.shape)} does not cover weight_packed "
                              f"{tuple(packed.shape)} with group_size {group_size}")


def _in_features(packed: Tensor, shape: Tensor | tuple[int, int] | None) -> int:
    return packed.shape[1] * 8 if shape is None else int(shape[1])


def unpack_int4(packed: Tensor) -> Tensor:
    """int32 [out, in/8] -> int8 [out, in]: element 8j+i sits in bits 4i..4i+3 of word j, stored as value + 8."""
    nibbles = [((packed >> (4 * i)) & 0xF) - 8 for i in range(8)]
    return torch.stack(nibbles, dim=-1).reshape(packed.shape[0], -1).to(torch.int8)


def dequant_int4_packed(packed: Tensor, scale: Tensor, group_size: int = 32,
                        shape: Tensor | tuple[int, int] | None = None) -> Tensor:
    """compressed-tensors int4 (symmetric, per-group scale) -> float32 [out, in]; shape is weight_shape."""
    _int4_check(packed, scale, group_size)
    in_features = _in_features(packed, shape)
    values = unpack_int4(packed)[:, :in_features].to(torch.float32)
    return values * scale.to(torch.float32).repeat_interleave(group_size, 1)[:, :in_features]


def _int4_decode(packed_bytes: Tensor, scale: Tensor, work: Tensor, out: Tensor) -> None:
    """Bytes [n, in/2] -> out [n, 2, in/2] (all low nibbles, then all high) as (nibble - 8) * group scale."""
    n, half = packed_bytes.shape
    torch.bitwise_and(packed_bytes, 0x0F, out=work[:, 0])
    torch.bitwise_right_shift(packed_bytes, 4, out=work[:, 1])
    work.sub_(8)  # uint8 wraps: reinterpreted as int8 below
    groups = scale.shape[1]
    torch.mul(work.view(torch.int8).view(n, 2, groups, -1), scale.view(n, 1, groups, 1),
              out=out.view(n, 2, groups, -1))


def int4_native(tokens: int, packed: Tensor, scale: Tensor, group_size: int, in_features: int) -> bool:
    """Whether int4_linear takes the native kernel: fewer than INT4_NATIVE_MAX_T rows, AVX-512, groups of 32, every
    stored element a real one (no padded last word), bf16 or fp32 scales, contiguous."""
    return (tokens < INT4_NATIVE_MAX_T and group_size == 32 and packed.shape[1] * 8 == in_features
            and scale.dtype in (torch.bfloat16, torch.float32) and packed.is_contiguous() and scale.is_contiguous()
            and cpu.available() and cpu.simd() == "avx512")


def int4_linear(x: Tensor, packed: Tensor, scale: Tensor, group_size: int = 32,
                shape: Tensor | tuple[int, int] | None = None, scratch: Tensor | None = None,
                rows_per_chunk: int | None = None, native: bool = True) -> Tensor:
    """y = x @ W^T for int4 pack-quantized W (float32 [..., out]): fewer than INT4_NATIVE_MAX_T rows on the native
    kernel where int4_native says so (the packed words read as stored, kernels/_cpu_fp8.c), otherwise decoding a
    chunk of rows at a time. The two differ by fp32 rounding only."""
    _int4_check(packed, scale, group_size)
    out_features, stored = packed.shape[0], packed.shape[1] * 8
    in_features = _in_features(packed, shape)
    lead = x.shape[:-1]
    x2 = cpu.rows(x, in_features)
    if native and int4_native(x2.shape[0], packed, scale, group_size, in_features):
        return cpu.linear_int4(x2, packed, scale).view(*lead, out_features)
    if stored != scale.shape[1] * group_size or group_size % 2:  # ragged last group: use the reference
        return _int4_linear_reference(x2, packed, scale, group_size, in_features).view(*lead, out_features)
    x2 = torch.nn.functional.pad(x2, (0, stored - in_features))  # padding codes decode to -8: zero their inputs
    xp = x2.view(-1, stored // 2, 2).transpose(1, 2).reshape(-1, stored)
    rows = _rows_per_chunk(rows_per_chunk, stored, scratch)
    buf = _scratch_rows(scratch, rows, stored)
    work = torch.empty(rows, 2, stored // 2, dtype=torch.uint8)
    byte_view = packed.contiguous().view(torch.uint8)  # little-endian: byte j holds elements 2j (low), 2j+1
    scale32 = scale.to(torch.float32)
    out = torch.empty(xp.shape[0], out_features, dtype=torch.float32)
    for r in range(0, out_features, rows):
        n = min(rows, out_features - r)
        _int4_decode(byte_view[r:r + n], scale32[r:r + n], work[:n], buf[:n])
        torch.mm(xp, buf[:n].T, out=out[:, r:r + n])
    return out.view(*lead, out_features)


def _int4_linear_reference(x: Tensor, packed: Tensor, scale: Tensor, group_size: int, in_features: int) -> Tensor:
    rows = max(1, SCRATCH_BYTES // (4 * in_features))
    parts = [x @ dequant_int4_packed(packed[r:r + rows], scale[r:r + rows], group_size, (0, in_features)).T
             for r in range(0, packed.shape[0], rows)]
    return torch.cat(parts, dim=1)


def pack_int4(w: Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """float32 [out, in] -> (weight_packed int32 [out, ceil(in/8)], weight_scale [out, ceil(in/gs)]).

    Symmetric: scale = absmax / 7 per group (stored in scale_dtype), q = round(w / scale) clamped to [-8, 7].
    """
    rows, cols = w.shape
    groups = math.ceil(cols / group_size)
    padded = torch.zeros(rows, groups * group_size)
    padded[:, :cols] = w.to(torch.float32)
    scale = (padded.view(rows, groups, group_size).abs().amax(-1) / 7.0).to(scale_dtype)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale).to(torch.float32)
    q = torch.round(padded.view(rows, groups, group_size) / divisor.unsqueeze(-1)).clamp(-8, 7)
    q = q.reshape(rows, -1)[:, :cols].to(torch.int32)
    return _pack_int32(q), scale


def _pack_int32(q: Tensor) -> Tensor:
    """int [out, in] in [-8, 7] -> int32 [out, ceil(in/8)], nibble i of word j = q[:, 8j+i] + 8 (pad: +0 -> -8)."""
    rows, cols = q.shape
    words = math.ceil(cols / 8)
    u = torch.zeros(rows, words * 8, dtype=torch.int64)
    u[:, :cols] = q.to(torch.int64) + 8
    shifted = u.view(rows, words, 8) << (4 * torch.arange(8, dtype=torch.int64))
    packed = shifted.sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


# ---------------------------------------------------------------------------------------------------- bandwidth


def bandwidth_probe(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Memory read bandwidth in bytes/s: best of `repeats` torch.sum passes over an nbytes float32 tensor."""
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.sum(data)
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best
