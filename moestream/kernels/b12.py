"""b12: a lossless 12-bit coding of bf16 matrices (`moestream pack --codec b12`), and the weight that holds one.

A bf16 value's low byte (the exponent's last bit and 7 mantissa bits) is stored as is; its high byte (sign and
the exponent's upper 7 bits) takes at most 16 values within most rows of a trained or randomly initialised
matrix, so it is stored as a 4-bit code against the row's base. A value that does not fit (2^15 or more below the
row's largest, an exact zero among them) makes its row stored whole, or, coded with exceptions (`exceptions=True`,
the "b12x" form), is kept beside the row as its position and bf16 bits: a wide Gaussian row (K3's 7,168 values)
holds one such value in two, so without exceptions most of its rows would be stored whole. The byte layout is
described in _cpu_b12.c, whose kernels read it directly: 1.5 bytes a value plus a byte a row (and 2 bytes a value
of the rows stored whole, 4 bytes a row and an exception of a matrix with exceptions), so a bf16 expert streams
25% fewer bytes from disk and from memory, and a third more of them fit a cache budget. Decoding gives back exactly the
stored bf16 bits: every product is the bf16 matrix's.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moestream.kernels import cpu
from moestream.kernels.qweight import QuantWeight, dense_rows_per_chunk

RAW = 0xFF  # base byte of a row stored whole
XFLAG = 0x80  # base byte | XFLAG: a coded row with exceptions (a base is at most 0x78)
MAX_XK = 32768  # rows of at most this many values may have exceptions (a position fits 16 bits; the kernels decode
#                 such a row into a stack buffer of this many values)
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


def _pad(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def table_nbytes(n: int, exceptions: int) -> int:
    """The exception table of an n-row matrix with this many exceptions: none without any, else the rows' uint32
    offsets into the entries (n + 1 of them) and the uint32 entries, each padded to 64 bytes."""
    return _pad(4 * (n + 1)) + _pad(4 * exceptions) if exceptions else 0


def coded_nbytes(n: int, k: int, raw_rows: int, exceptions: int = 0) -> int:
    return n * slot_bytes(k) + _pad(n) + table_nbytes(n, exceptions) + raw_rows * 2 * k


def _high_bits(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(bits, upper exponent bits, base) per value / row of a bf16 matrix, as int32."""
    bits = w.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    hi7 = (bits >> 8) & 0x7F
    return bits, hi7, (hi7.amax(1) - 7).clamp(min=0)


def _rows_kind(hi7: Tensor, base: Tensor, exceptions: bool, misfit: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
    """(the values that do not fit [rows, K], the rows stored whole, the rows coded with exceptions): a row keeps
    its misfits as exceptions (with `exceptions`, K <= MAX_XK) while they take at most K bytes (4 bytes each:
    a row stored whole costs 2K bytes more than its slot)."""
    misfit = hi7 < base[:, None] if misfit is None else misfit
    count = misfit.sum(1)
    k = hi7.shape[1]
    xrow = (count > 0) & (4 * count <= k) if exceptions and k <= MAX_XK else torch.zeros_like(count, dtype=torch.bool)
    return misfit, (count > 0) & ~xrow, xrow


def scan(w: Tensor, exceptions: bool = False) -> tuple[int, int]:
    """(rows stored whole, exceptions) of a bf16 matrix's coding (or of some of its rows: the counts add up)."""
    return scan_forms(w)[int(exceptions)]


def scan_forms(w: Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """scan(w) and scan(w, exceptions=True) from one pass over the values."""
    _, hi7, base = _high_bits(w)
    misfit = hi7 < base[:, None]
    plain = int(misfit.any(1).sum())
    _, raw, xrow = _rows_kind(hi7, base, True, misfit)
    return (plain, 0), (int(raw.sum()), int(misfit[xrow].sum()))


def smaller_form(w: Tensor) -> tuple[int, int]:
    """(rows stored whole, exceptions) of the smaller of a bf16 matrix's two codings, plain b12 or b12x: how
    `moestream pack` sizes and codes an expert matrix (encode_smaller)."""
    return min(scan_forms(w), key=lambda f: coded_nbytes(*w.shape, *f))


def encode_smaller(w: Tensor) -> Tensor:
    """encode(w) in its smaller form (smaller_form), as `moestream pack` codes an expert matrix."""
    return encode(w, exceptions=smaller_form(w)[1] > 0)


def raw_rows(w: Tensor) -> int:
    """How many rows of a bf16 matrix the coding without exceptions stores whole."""
    return scan(w)[0]


def encode_rows(w: Tensor, n: int, raw_before: int, exceptions: bool = False, table: int = 0
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Some consecutive rows of an n-row bf16 matrix being coded (w [rows, K]), `raw_before` rows above them
    stored whole, `table` the whole matrix's exception table bytes (table_nbytes): (their slots uint8
    [rows, K * 3 / 2], their base bytes uint8 [rows], the indices within w of the rows stored whole, each row's
    exception count int64 [rows], their exceptions int32 [E] as (position << 16 | bf16 bits), rows in order). A
    matrix too large to code at once (K3's 2.3 GB lm_head) is coded a slab at a time: the slots in order, then every
    base byte, then the exception table, then the rows stored whole in order (`encode` puts them together)."""
    rows, k = w.shape
    bits, hi7, base = _high_bits(w)
    misfit, raw, xrow = _rows_kind(hi7, base, exceptions)
    misfit = misfit & xrow[:, None]
    counts = misfit.sum(1).to(torch.int64)
    cols = misfit.nonzero()[:, 1]  # row-major: each row's exceptions in order of position
    entries = ((cols.to(torch.int64) << 16) | bits[misfit].to(torch.int64)).to(torch.int32)  # positions < 2^15
    code = ((hi7 - base[:, None]).clamp(0, 7) | ((bits >> 15) << 3)).to(torch.uint8)
    lo = (bits & 0xFF).to(torch.uint8)
    blocks = k // BLOCK
    lo = lo.view(rows, blocks, BLOCK)[:, :, _POS]
    code = code.view(rows, blocks, BLOCK)[:, :, _POS]
    packed = code[:, :, :32] | (code[:, :, 32:] << 4)
    slots = torch.cat([lo, packed], dim=2).reshape(rows, slot_bytes(k))
    raw_ids = raw.nonzero().flatten()
    bases = base.to(torch.uint8)
    bases[xrow] |= XFLAG
    if len(raw_ids):  # a raw row's slot holds the byte offset of its bf16 row after the slots, bases and table
        bases[raw_ids] = RAW
        head = n * slot_bytes(k) + _pad(n) + table
        offsets = head + 2 * k * (raw_before + torch.arange(len(raw_ids), dtype=torch.int64))
        slots[raw_ids, :8] = offsets.view(torch.uint8).view(len(raw_ids), 8)
    return slots, bases, raw_ids, counts, entries


def table_bytes(n: int, counts: Tensor, entries: Tensor) -> bytes:
    """The exception table (table_nbytes(n, len(entries)) bytes) of an n-row matrix from its rows' exception counts
    and entries; empty without exceptions."""
    if not len(entries):
        return b""
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    out = bytearray(table_nbytes(n, len(entries)))
    off = offsets.to(torch.int32).numpy().tobytes()
    out[:len(off)] = off
    ent = entries.numpy().tobytes()
    out[_pad(4 * (n + 1)):_pad(4 * (n + 1)) + len(ent)] = ent
    return bytes(out)


def encode(w: Tensor, exceptions: bool = False) -> Tensor:
    """The b12 bytes (uint8, 1-D) of a bf16 matrix [N, K], K % 64 == 0 (with `exceptions`, the b12x form)."""
    if not supported(tuple(w.shape), w.dtype):
        raise ValueError(f"b12 codes 2-D bfloat16 matrices with rows a multiple of {BLOCK}, got "
                         f"{tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    n_raw, n_exc = scan(w, exceptions)
    table = table_nbytes(n, n_exc)
    slots, bases, raw_ids, counts, entries = encode_rows(w, n, 0, exceptions, table)
    head = n * slot_bytes(k) + _pad(n)
    out = torch.zeros(coded_nbytes(n, k, n_raw, n_exc), dtype=torch.uint8)
    if len(raw_ids):
        out[head + table:] = w[raw_ids].contiguous().view(torch.uint8).reshape(-1)
    if table:
        out[head:head + table] = torch.frombuffer(bytearray(table_bytes(n, counts, entries)), dtype=torch.uint8)
    out[:n * slot_bytes(k)] = slots.reshape(-1)
    out[n * slot_bytes(k):n * slot_bytes(k) + n] = bases
    return out


def exception_table(data: Tensor, n: int, k: int) -> tuple[Tensor, Tensor] | None:
    """(offsets int64 [n + 1], entries int64 [E]) of a coded matrix's exception table, None where no row has
    exceptions; ValueError where it breaks the layout (check_table)."""
    at = n * slot_bytes(k)
    return check_table(data[at:at + n], data[at + _pad(n):], n, k)


def check_table(bases: Tensor, table: Tensor, n: int, k: int) -> tuple[Tensor, Tensor] | None:
    """An exception table checked against its matrix's base bytes (uint8 [n]) before any kernel reads it: `table`
    (uint8) starts at it. None where no row is flagged. ValueError where the table does not fit the bytes, its offsets
    do not rise from 0 or disagree with the flagged rows (a flagged row without exceptions, an unflagged one with
    some), or a position is past its row or out of order within it."""
    flagged = (bases & XFLAG).bool() & (bases != RAW)
    if not bool(flagged.any()):
        return None
    if k > MAX_XK:
        raise ValueError(f"b12: rows of {k} values cannot have exceptions (at most {MAX_XK})")
    if table.numel() < 4 * (n + 1):
        raise ValueError("b12: the exception table's offsets run past the matrix's bytes")
    offsets = table[:4 * (n + 1)].clone().view(torch.int32).to(torch.int64)
    count = int(offsets[-1])
    steps = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or bool((steps < 0).any()) or not bool(((steps > 0) == flagged).all()) \
            or table.numel() < table_nbytes(n, count):
        raise ValueError("b12: the exception table's offsets do not match the rows coded with exceptions")
    start = _pad(4 * (n + 1))
    entries = table[start:start + 4 * count].clone().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    pos = entries >> 16
    row = torch.repeat_interleave(torch.arange(n), steps)
    rising = (pos[1:] > pos[:-1]) | (row[1:] != row[:-1])
    if bool((pos >= k).any()) or not bool(rising.all()):
        raise ValueError("b12: an exception's position is past its row or out of order")
    return offsets, entries


CHECK_FAILS = {1: "its bytes are too few for its shape", 2: "a row stored whole points outside its bytes",
               3: "its exception table is damaged"}


def check_bytes(data: Tensor, n: int, k: int) -> None:
    """ValueError where the native kernels may not read the coded n x k matrix in `data` (uint8, contiguous): too
    few bytes for the slots and base bytes, a row stored whole whose offset points outside them (or into them), an
    exception table that does not fit (check_table). A packed expert is checked after its read (experts/store.py),
    before any kernel reads it: its crc32 says the bytes are those packed, this that they are safe to read."""
    if cpu.available():
        code = cpu.b12_check(data, n, k)
        if code:
            raise ValueError(f"b12: {CHECK_FAILS.get(code, code)}")
        return
    head = n * slot_bytes(k) + _pad(n)
    if n <= 0 or k <= 0 or k % BLOCK or data.numel() < head:
        raise ValueError(f"b12: {CHECK_FAILS[1]}")
    table = exception_table(data, n, k)  # ValueError where damaged
    start = head + (table_nbytes(n, len(table[1])) if table is not None else 0)
    bases = data[n * slot_bytes(k):n * slot_bytes(k) + n]
    raw = (bases == RAW).nonzero().flatten()
    if len(raw):
        slots = data[:n * slot_bytes(k)].view(n, slot_bytes(k))
        off = slots[raw, :8].contiguous().view(torch.int64).flatten()
        if bool(((off < start) | (off % 2 != 0) | (off > data.numel() - 2 * k)).any()):
            raise ValueError(f"b12: {CHECK_FAILS[2]}")


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
    base = (bases & 0x7F).view(-1, 1, 1)
    hi = torch.where(code < 8, base + code, 0x80 | (base + code - 8))
    vals = ((hi << 8) | lo)[:, :, _INV].reshape(rows, k)
    table = exception_table(data, n, k)
    if table is not None:
        offsets, entries = table
        for r in ((bases & XFLAG).bool() & (bases != RAW)).nonzero().flatten().tolist():
            e = entries[int(offsets[start + r]):int(offsets[start + r + 1])]
            vals[r, e >> 16] = (e & 0xFFFF).to(torch.int32)
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
