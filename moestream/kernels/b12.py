"""b12: a lossless 12-bit coding of bf16 matrices (`moestream pack --codec b12`), and the weight that holds one.

A bf16 value's low byte (the exponent's last bit and 7 mantissa bits) is stored as is; its high byte (sign and
the exponent's upper 7 bits) takes at most 16 values within most rows of a trained or randomly initialised
matrix, so it is stored as a 4-bit code against the row's base. Rows where it does not fit (a value 2^15 or more
below the row's largest, an exact zero among them) are stored whole. The byte layout is described in
_cpu_b12.c, whose kernels read it directly: 1.5 bytes a value plus a byte a row (and 2 bytes a value of the rows
stored whole), so a bf16 expert streams 25% fewer bytes from disk and from memory, and 25% more of them fit a
cache budget. Decoding gives back exactly the stored bf16 bits: every product is the bf16 matrix's.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moestream.kernels import cpu
from moestream.kernels.qweight import QuantWeight, dense_rows_per_chunk

RAW = 0xFF  # base byte of a row stored whole
BLOCK = 64  # values per coded block (64 low bytes, 32 code bytes)
EXPAND_SLAB = 256 << 10  # bf16 bytes decoded at a time by B12Weight.expand_into


def _positions() -> Tensor:
    """Block position p holds value _positions()[p] (the order an AVX-512 byte unpack of 128-bit lanes gives)."""
    p = torch.arange(BLOCK)
    return torch.where(p % 16 < 8, 8 * (p // 16) + p % 16, 32 + 8 * (p // 16) + p % 16 - 8)


_POS = _positions()
_INV = torch.argsort(_POS)


def supported(shape: tuple[int, ...], dtype) -> bool:
    """Whether a tensor of this shape and dtype can be coded: 2-D bf16 with rows a multiple of 64 values."""
    return dtype == torch.bfloat16 and len(shape) == 2 and shape[1] > 0 and shape[1] % BLOCK == 0 and shape[0] > 0


def slot_bytes(k: int) -> int:
    return k * 3 // 2


def coded_nbytes(n: int, k: int, raw_rows: int) -> int:
    return n * slot_bytes(k) + -(-n // 64) * 64 + raw_rows * 2 * k


def _high_bits(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(bits, upper exponent bits, base) per value / row of a bf16 matrix, as int32."""
    bits = w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    hi7 = (bits >> 8) & 0x7F
    return bits, hi7, (hi7.amax(1) - 7).clamp(min=0)


def raw_rows(w: Tensor) -> int:
    """How many rows of a bf16 matrix the coding stores whole."""
    _, hi7, base = _high_bits(w)
    return int((hi7 < base[:, None]).any(1).sum())


def encode_rows(w: Tensor, n: int, raw_before: int) -> tuple[Tensor, Tensor, Tensor]:
    """Some consecutive rows of an n-row bf16 matrix being coded (w [rows, K]), `raw_before` rows above them
    stored whole: (their slots uint8 [rows, K * 3 / 2], their base bytes uint8 [rows], the indices within w of
    the rows stored whole). A matrix too large to code at once (K3's 2.3 GB lm_head) is coded a slab at a time:
    the slots in order, then every base byte, then the rows stored whole in order (`encode` puts them together)."""
    rows, k = w.shape
    bits, hi7, base = _high_bits(w)
    raw = (hi7 < base[:, None]).any(1)
    code = ((hi7 - base[:, None]).clamp(0, 7) | ((bits >> 15) << 3)).to(torch.uint8)
    lo = (bits & 0xFF).to(torch.uint8)
    blocks = k // BLOCK
    lo = lo.view(rows, blocks, BLOCK)[:, :, _POS]
    code = code.view(rows, blocks, BLOCK)[:, :, _POS]
    packed = code[:, :, :32] | (code[:, :, 32:] << 4)
    slots = torch.cat([lo, packed], dim=2).reshape(rows, slot_bytes(k))
    raw_ids = raw.nonzero().flatten()
    bases = base.to(torch.uint8)
    if len(raw_ids):  # a raw row's slot holds the byte offset of its bf16 row after the slots and bases
        bases[raw_ids] = RAW
        head = n * slot_bytes(k) + -(-n // 64) * 64
        offsets = head + 2 * k * (raw_before + torch.arange(len(raw_ids), dtype=torch.int64))
        slots[raw_ids, :8] = offsets.view(torch.uint8).view(len(raw_ids), 8)
    return slots, bases, raw_ids


def encode(w: Tensor) -> Tensor:
    """The b12 bytes (uint8, 1-D) of a bf16 matrix [N, K], K % 64 == 0."""
    if not supported(tuple(w.shape), w.dtype):
        raise ValueError(f"b12 codes 2-D bfloat16 matrices with rows a multiple of {BLOCK}, got "
                         f"{tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    slots, bases, raw_ids = encode_rows(w, n, 0)
    head = n * slot_bytes(k) + -(-n // 64) * 64
    out = torch.zeros(coded_nbytes(n, k, len(raw_ids)), dtype=torch.uint8)
    if len(raw_ids):
        out[head:] = w[raw_ids].contiguous().view(torch.uint8).reshape(-1)
    out[:n * slot_bytes(k)] = slots.reshape(-1)
    out[n * slot_bytes(k):n * slot_bytes(k) + n] = bases
    return out


def decode_rows(data: Tensor, n: int, k: int, start: int, stop: int) -> Tensor:
    """bf16 rows [start, stop) of the coded N x K matrix in `data` (uint8), exactly the encoded values."""
    slots = data[:n * slot_bytes(k)].view(n, slot_bytes(k))[start:stop]
    bases = data[n * slot_bytes(k) + start:n * slot_bytes(k) + stop].to(torch.int32)
    rows = stop - start
    blocks = k // BLOCK
    s = slots.view(rows, blocks, 96)
    lo = s[:, :, :BLOCK].to(torch.int32)
    cb = s[:, :, BLOCK:].to(torch.int32)
    code = torch.cat([cb & 15, cb >> 4], dim=2)
    hi = torch.where(code < 8, bases.view(-1, 1, 1) + code, 0x80 | (bases.view(-1, 1, 1) + code - 8))
    vals = ((hi << 8) | lo)[:, :, _INV].reshape(rows, k)
    out = vals.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 keeps the low 16 bits
    for r in (bases == RAW).nonzero().flatten().tolist():
        off = int(slots[r, :8].contiguous().view(torch.int64))
        out[r] = data[off:off + 2 * k].view(torch.bfloat16)
    return out


def decode(data: Tensor, n: int, k: int) -> Tensor:
    return decode_rows(data, n, k, 0, n)


class B12Weight(QuantWeight):
    """A b12-coded bf16 matrix [out, in]: the coded bytes (uint8, 1-D) as a plain-storage tensor. The native GLU
    kernels read the bytes (blocks.glu_parts passes the address tagged, _cpu_b12.c); `linear` and `rows` decode a
    bounded chunk of rows at a time to fp32 for every other path."""

    @staticmethod
    def wrap(data: Tensor, shape: tuple[int, int]) -> "B12Weight":
        out = data.as_subclass(B12Weight)
        out.out_features, out.in_features = int(shape[0]), int(shape[1])
        return out

    @property
    def tagged_address(self) -> int:
        return self.codes.data_ptr() | 1

    def expand_into(self, dst: Tensor) -> Tensor:
        """The matrix decoded into dst (a float tensor [out, in], e.g. an fp32 expansion buffer), a bounded slab of
        bf16 rows at a time; returns dst."""
        return self.expand_rows_into(0, dst)

    def expand_rows_into(self, start: int, dst: Tensor) -> Tensor:
        """Rows [start, start + len(dst)) decoded into dst (a float tensor [rows, in]), a bounded slab of bf16 rows
        at a time (natively where the kernels are built); returns dst."""
        n, k = self.out_features, self.in_features
        step = max(1, EXPAND_SLAB // (2 * k))
        buf = torch.empty(min(step, dst.shape[0]), k, dtype=torch.bfloat16) if cpu.available() else None
        for r in range(start, start + dst.shape[0], step):
            stop = min(start + dst.shape[0], r + step)
            rows = cpu.b12_decode_rows(self.codes, n, k, r, stop, buf[:stop - r]) if buf is not None \
                else decode_rows(self.codes, n, k, r, stop)
            dst[r - start:stop - start].copy_(rows)
        return dst

    def rows(self, start: int, stop: int) -> Tensor:
        return self.expand_rows_into(start, torch.empty(stop - start, self.in_features))

    def linear(self, x: Tensor) -> Tensor:
        xs = x.reshape(-1, self.in_features).float()
        out = torch.empty(xs.shape[0], self.out_features, dtype=torch.float32)
        step = dense_rows_per_chunk(self.in_features)
        for r in range(0, self.out_features, step):
            stop = min(self.out_features, r + step)
            torch.mm(xs, self.rows(r, stop).T, out=out[:, r:stop])
        return out.reshape(*x.shape[:-1], self.out_features)
