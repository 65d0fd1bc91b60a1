"""MLA's kv_b_proj split per head, prepared once: the key half W_UK [H, dn, r] and the value half W_UV [H, dv, r].

Owns the three products attention needs from kv_b: the query folded into the latent space (q_nope W_UK, absorbed
form), the latent context brought back out (ctx W_UV^T), and per-head keys / values of a tile of latents (expanded
form). A resident bf16 kv_b keeps W_UK transposed once (counted as dense bytes) so a decode step's fold and
unfold are one threaded native bf16 call each (all heads at once, no upcast, no loop over heads). A resident
block-FP8 kv_b whose heads fall on whole scale blocks (DeepSeek-V3's) stays FP8 the same way: W_UK's codes and
scales transposed once (the key halves' bytes again, counted), each product of fewer than FP8_NATIVE_MAX_T rows
one native FP8 call, larger steps a bounded chunk of heads upcast at a time. Other quantised ones (int4, unaligned
FP8) are dequantised once to fp32 at load (exact, counted). A streamed kv_b (refilled each step) is used as it is:
the same native products, bf16 or block-FP8 (the key halves transposed per step: for DeepSeek-V3's FP8 kv_b 8 MiB of
codes a layer, where upcasting the heads cost ~0.15 s a layer a token), and for larger steps a bounded chunk of
heads upcast at a time.
"""
from __future__ import annotations

import torch

from moestream.kernels import cpu, quant
from moestream.kernels.qweight import BlockFp8Weight, QuantWeight, dense_float_rows
from moestream.memory.accountant import MemoryAccountant

HEAD_CHUNK_BYTES = 16 << 20  # fp32 bytes of kv_b heads upcast at once where a product cannot use the stored form


class LatentHeads:
    def __init__(self, kv_b: torch.Tensor, heads: int, dn: int, dv: int, rank: int,
                 memory: MemoryAccountant | None):
        """memory None: kv_b streams (its storage refilled before each use), so nothing is prepared from it."""
        self.kv_b, self.heads, self.dn, self.dv, self.rank = kv_b, heads, dn, dv, rank
        self.w32: torch.Tensor | None = None  # [H, dn + dv, r] fp32, when resident in (or dequantised to) fp32
        self.uk_t: torch.Tensor | None = None  # [H, r, dn] bf16 contiguous: native per-head query fold
        self.uk_t8: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8 W_UK^T codes [H * r, dn], scales
        # a streamed block-FP8 kv_b the native kernel reads per head: its key halves transposed per step
        self.fp8_streamed = memory is None and self._fp8_aligned()
        if memory is None:
            return
        if self._fp8_aligned():
            self.uk_t8 = self._fp8_key_halves_t()
            memory.add_dense(sum(t.numel() * t.element_size() for t in self.uk_t8))
        elif isinstance(kv_b, QuantWeight) or kv_b.dtype not in (torch.bfloat16, torch.float32):
            self.w32 = self._dequantised()
            memory.add_dense(self.w32.numel() * 4)
        elif kv_b.dtype == torch.float32:
            self.w32 = kv_b.view(heads, dn + dv, rank)
        elif cpu.available():
            self.uk_t = self._key_halves_t()
            memory.add_dense(self.uk_t.numel() * self.uk_t.element_size())

    def _per_head(self, w: torch.Tensor) -> torch.Tensor:
        return w.view(self.heads, self.dn + self.dv, self.rank)

    def _dequantised(self) -> torch.Tensor:
        """kv_b as fp32 [H, dn + dv, r], decoded a bounded chunk of rows at a time (no whole-tensor temporaries)."""
        rows = self.heads * (self.dn + self.dv)
        out = torch.empty(rows, self.rank)
        step = max(1, HEAD_CHUNK_BYTES // (4 * self.rank))
        for r in range(0, rows, step):
            out[r:r + step] = dense_float_rows(self.kv_b, r, min(rows, r + step))
        return self._per_head(out)

    def _fp8_aligned(self) -> bool:
        """A block-FP8 kv_b the native FP8 kernel can read per head: every head's key and value halves whole scale
        row blocks, the rank a whole number of column blocks, widths multiples of 64, codes contiguous."""
        if not isinstance(self.kv_b, BlockFp8Weight):
            return False
        br, bc = self.kv_b.block
        return (self.dn % br == 0 and self.dv % br == 0 and self.rank % bc == 0 and self.kv_b.codes.is_contiguous()
                and quant.fp8_native(1, self.rank, (br, bc)) and quant.fp8_native(1, self.dn, (bc, br)))

    def _fp8_key_halves_t(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's W_UK^T as FP8 codes [H * r, dn] and its scale_inv [H * r / bc, dn / br] (blocks transposed)."""
        br, bc = self.kv_b.block
        per = self.dn + self.dv
        codes = self.kv_b.codes.view(torch.uint8).view(self.heads, per, self.rank)[:, :self.dn]
        codes_t = codes.transpose(1, 2).contiguous().view(self.heads * self.rank, self.dn)
        grid = self.kv_b.scale_inv.to(torch.float32).view(self.heads, per // br, self.rank // bc)[:, :self.dn // br]
        scales_t = grid.transpose(1, 2).contiguous().view(self.heads * self.rank // bc, self.dn // br)
        return codes_t, scales_t

    def _fp8(self, tokens: int) -> bool:
        return (self.uk_t8 is not None or self.fp8_streamed) and tokens < quant.FP8_NATIVE_MAX_T

    def _native(self, tokens: int) -> bool:
        """bf16 kv_b and few rows: per-head native products (a streamed kv_b too, so streaming changes no bit)."""
        return self.w32 is None and cpu.bf16_native(self.kv_b, tokens=tokens)

    def _key_halves_t(self) -> torch.Tensor:
        """Every head's W_UK^T [H, r, dn] bf16 contiguous, transposed now (a streamed kv_b: 1/2 of its bytes)."""
        return self._per_head(self.kv_b)[:, :self.dn].transpose(1, 2).contiguous()

    def _chunks(self):
        """(h0, h1, fp32 [h1 - h0, dn + dv, r]) over all heads: views of w32, else a bounded upcast of kv_b."""
        if self.w32 is not None:
            yield 0, self.heads, self.w32
            return
        per = self.dn + self.dv
        step = max(1, HEAD_CHUNK_BYTES // (4 * per * self.rank))
        for h0 in range(0, self.heads, step):
            h1 = min(self.heads, h0 + step)
            yield h0, h1, dense_float_rows(self.kv_b, h0 * per, h1 * per).view(h1 - h0, per, self.rank)

    def fold_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [H, n, dn] -> [H, n, r]: each head's query through its key half (absorbed attention)."""
        h, n, _ = q_nope.shape
        if self._fp8(n):  # every head in one native FP8 call on the transposed key halves' codes
            br, bc = self.kv_b.block
            codes_t, scales_t = self.uk_t8 if self.uk_t8 is not None else self._fp8_key_halves_t()
            return cpu.linear_fp8_heads(q_nope, codes_t, scales_t, self.rank, 0, self.rank, (bc, br))
        if self._native(n):  # every head in one threaded native call on the transposed key halves
            uk_t = self.uk_t if self.uk_t is not None else self._key_halves_t()
            return cpu.linear_bf16_heads(q_nope, uk_t, 0, self.rank * self.dn, self.rank)
        out = torch.empty(h, n, self.rank)
        for h0, h1, w in self._chunks():
            torch.matmul(q_nope[h0:h1], w[:, :self.dn], out=out[h0:h1])
        return out

    def unfold_context(self, ctx: torch.Tensor) -> torch.Tensor:
        """ctx [H, n, r] (attention over the latents) -> [H, n, dv] through each head's value half."""
        h, n, _ = ctx.shape
        if self._fp8(n):  # the value halves' codes read in place, one native FP8 call
            return cpu.linear_fp8_heads(ctx, self.kv_b.codes, self.kv_b.scale_inv, self.dn + self.dv, self.dn,
                                        self.dv, self.kv_b.block)
        if self._native(n):  # the value halves are contiguous row blocks of kv_b: read in place, one call
            kv_b = self.kv_b if self.kv_b.is_contiguous() else self.kv_b.contiguous()
            return cpu.linear_bf16_heads(ctx, kv_b, self.dn * self.rank, (self.dn + self.dv) * self.rank, self.dv)
        out = torch.empty(h, n, self.dv)
        for h0, h1, w in self._chunks():
            torch.matmul(ctx[h0:h1], w[:, self.dn:].transpose(1, 2), out=out[h0:h1])
        return out

    def expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents c [k, r] -> per-head keys [H, k, dn] and values [H, k, dv] (expanded attention, one key tile)."""
        keys = torch.empty(self.heads, c.shape[0], self.dn)
        values = torch.empty(self.heads, c.shape[0], self.dv)
        for h0, h1, w in self._chunks():
            torch.matmul(c, w[:, :self.dn].transpose(1, 2), out=keys[h0:h1])
            torch.matmul(c, w[:, self.dn:].transpose(1, 2), out=values[h0:h1])
        return keys, values
