"""Quantised dense weights (block-FP8, compressed-tensors int4) multiplied in bounded row chunks by blocks.linear,
against the dequantise-everything reference."""
from __future__ import annotations

import pytest
import torch

from moestream.kernels.qweight import BlockFp8Weight, Int4Weight, dense_float_rows, dense_rows_per_chunk
from moestream.kernels.quant import dequant_fp8_block, dequant_int4_packed, pack_int4, quantize_fp8_block
from moestream.models.blocks import linear, linear_many


def _fp8(rows: int, cols: int, block: tuple[int, int]) -> tuple[BlockFp8Weight, torch.Tensor]:
    q, s = quantize_fp8_block(torch.randn(rows, cols), block)
    return BlockFp8Weight.wrap(q, s, block), dequant_fp8_block(q, s, block)


def _int4(rows: int, cols: int, group: int) -> tuple[Int4Weight, torch.Tensor]:
    packed, scale = pack_int4(torch.randn(rows, cols), group)
    return Int4Weight.wrap(packed, scale, group, (rows, cols)), dequant_int4_packed(packed, scale, group, (rows, cols))


@pytest.mark.parametrize("shape,block", [((40, 64), (32, 32)), ((200, 300), (128, 128)), ((130, 96), (32, 64))])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fp8_dense_linear_matches_dequantised(shape, block, tokens):
    torch.manual_seed(0)
    w, ref = _fp8(*shape, block)
    x, b = torch.randn(tokens, shape[1]), torch.randn(shape[0]).to(torch.bfloat16)
    want = x @ ref.T + b.float()
    got = linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (tokens, shape[0])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape,group", [((48, 64), 32), ((70, 100), 32), ((33, 256), 128)])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_int4_dense_linear_matches_dequantised(shape, group, tokens):
    torch.manual_seed(1)
    w, ref = _int4(*shape, group)
    x = torch.randn(2, tokens, shape[1])  # leading dims kept
    got = linear(x, w)
    assert got.shape == (2, tokens, shape[0])
    assert torch.allclose(got, x @ ref.T, rtol=1e-5, atol=1e-4)


def test_rows_are_exact_slices_of_the_dequantised_weight():
    torch.manual_seed(2)
    w8, ref8 = _fp8(300, 64, (128, 32))
    w4, ref4 = _int4(50, 70, 32)
    for start, stop in ((0, 300), (5, 133), (128, 129), (250, 300)):  # unaligned starts decode from the block's row
        assert torch.equal(dense_float_rows(w8, start, stop), ref8[start:stop])
    assert torch.equal(dense_float_rows(w4, 3, 41), ref4[3:41])
    assert torch.equal(w8.float(), ref8) and torch.equal(w4.float(), ref4)
    assert type(w8.float()) is torch.Tensor and type(w8[:2]) is torch.Tensor  # raw codes never leak as values


def test_chunks_are_bounded_and_several():
    """The chunk is a few MiB of fp32 rows whatever the width, so DeepSeek-V3's o_proj (16384 inputs) decodes in
    many chunks, never as one 470 MB fp32 copy."""
    assert dense_rows_per_chunk(16384) * 16384 * 4 <= 8 << 20
    assert 7168 // dense_rows_per_chunk(16384) >= 50
    torch.manual_seed(3)
    w, ref = _fp8(520, 128, (128, 128))  # several chunks per row block when the chunk is forced small
    from moestream.kernels.quant import fp8_block_linear
    x = torch.randn(3, 128)
    got = fp8_block_linear(x, w.codes, w.scale_inv, w.block, rows_per_chunk=7)
    assert torch.allclose(got, x @ ref.T, rtol=1e-5, atol=1e-4)


def test_linear_many_mixes_quantised_and_plain_weights():
    torch.manual_seed(4)
    w8, ref8 = _fp8(40, 64, (32, 32))
    plain = torch.randn(24, 64).to(torch.bfloat16)
    x = torch.randn(2, 64)
    a, b = linear_many(x, (w8, plain))
    assert torch.allclose(a, x @ ref8.T, rtol=1e-5, atol=1e-4)
    assert torch.allclose(b, x @ plain.float().T, rtol=1e-5, atol=1e-4)


def test_checkpoint_dense_weights_load_as_stored_and_multiply(tmp_path):
    """QuantDenseWeights answers `X.weight` for an FP8 weight (+ weight_scale_inv) and for an int4 one
    (weight_packed + weight_scale + weight_shape), keeping the stored bytes as the resident dense bytes."""
    from safetensors.torch import save_file

    from moestream.memory.accountant import MemoryAccountant
    from moestream.models.base import DenseWeights
    from moestream.models.deepseek_v3 import QuantDenseWeights
    from moestream.weights.index import CheckpointIndex

    torch.manual_seed(5)
    q, s = quantize_fp8_block(torch.randn(64, 96), (32, 32))
    packed, scale = pack_int4(torch.randn(40, 100), 32)
    tensors = {"a.weight": q, "a.weight_scale_inv": s, "b.weight_packed": packed, "b.weight_scale": scale,
               "b.weight_shape": torch.tensor([40, 100]), "c.weight": torch.randn(8, 96).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    memory = MemoryAccountant(None)
    w = QuantDenseWeights(DenseWeights(CheckpointIndex.open(tmp_path), "", memory), (32, 32), 32)
    a, b, c = w.get("a.weight"), w.get("b.weight"), w.get("c.weight")
    assert isinstance(a, BlockFp8Weight) and isinstance(b, Int4Weight) and type(c) is torch.Tensor
    assert "b.weight" in w and (b.out_features, b.in_features) == (40, 100) and w.get("b.weight") is b
    assert memory.dense_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    x = torch.randn(3, 96)
    assert torch.allclose(linear(x, a), x @ dequant_fp8_block(q, s, (32, 32)).T, rtol=1e-5, atol=1e-4)
    x = torch.randn(3, 100)
    assert torch.allclose(linear(x, b), x @ dequant_int4_packed(packed, scale, 32, (40, 100)).T, rtol=1e-5, atol=1e-4)
