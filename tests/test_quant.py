"""Weight-format kernels: MXFP4, block FP8 and int4 decode exactly, and every *_linear matches its dequant."""

import math

import pytest
import torch

from moestream.errors import CheckpointError
from moestream.kernels import quant as q

OCP_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _random_mxfp4(rows: int, cols: int, seed: int = 0, low: int = 120, high: int = 131):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(low, high, (rows, cols // 32), dtype=torch.uint8, generator=g)
    return packed, scales


def _assert_matmul_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """allclose at fp32 rounding: rtol 1e-5 plus an atol that covers cancellation in the dot products."""
    want = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=float(bound.max()) * 1e-6)
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=float(bound.max()) * 1e-6)


# ------------------------------------------------------------------------------------------------- MXFP4 decode


def test_e2m1_table_is_ocp():
    assert q.E2M1_VALUES.dtype == torch.float32
    assert q.E2M1_VALUES.tolist() == OCP_E2M1
    assert math.copysign(1.0, float(q.E2M1_VALUES[8])) == -1.0  # code 8 is -0.0


@pytest.mark.parametrize("position", ["low", "high"])
def test_all_codes_decode_in_both_nibbles(position):
    codes = torch.arange(16, dtype=torch.uint8)
    other = torch.full_like(codes, 2)  # decodes to 1.0
    lo, hi = (codes, other) if position == "low" else (other, codes)
    packed = (lo | (hi << 4)).view(16, 1).expand(16, 16).contiguous()  # 16 rows, 32 inputs each
    scales = torch.full((16, 1), 127, dtype=torch.uint8)
    w = q.dequant_mxfp4(packed, scales)
    checked = w[:, 0::2] if position == "low" else w[:, 1::2]
    untouched = w[:, 1::2] if position == "low" else w[:, 0::2]
    assert checked[:, 0].tolist() == OCP_E2M1
    assert torch.signbit(checked[8, 0])
    assert (checked == checked[:, :1]).all() and (untouched == 1.0).all()


@pytest.mark.parametrize("s", [0, 1, 2, 100, 127, 128, 200, 254])
def test_scale_bytes_exact(s):
    packed = torch.full((1, 16), 0x12, dtype=torch.uint8)  # codes 2 (1.0) and 1 (0.5)
    scales = torch.tensor([[s]], dtype=torch.uint8)
    w = q.dequant_mxfp4(packed, scales)
    one = torch.tensor(math.ldexp(1.0, s - 127), dtype=torch.float64).float()
    half = torch.tensor(math.ldexp(0.5, s - 127), dtype=torch.float64).float()
    assert one.item() == math.ldexp(1.0, s - 127) and half.item() == math.ldexp(0.5, s - 127)
    assert (w[0, 0::2] == one).all() and (w[0, 1::2] == half).all()
    assert q.e8m0_to_float(scales).item() == math.ldexp(1.0, s - 127)


def test_scale_zero_is_subnormal_and_nonzero():
    value = q.e8m0_to_float(torch.tensor([0], dtype=torch.uint8))
    assert value.item() == 2.0 ** -127 and value.item() < torch.finfo(torch.float32).tiny


def test_nan_scale_raises_naming_tensor_and_block():
    packed, scales = _random_mxfp4(4, 96)
    scales[2, 1] = 255
    scales[3, 0] = 255
    name = "layers.7.block_sparse_moe.experts.3.w1.weight_scale"
    for call in (lambda: q.dequant_mxfp4(packed, scales, name=name),
                 lambda: q.mxfp4_linear(torch.randn(1, 96), packed, scales, name=name)):
        with pytest.raises(CheckpointError) as info:
            call()
        assert name in str(info.value) and "row 2" in str(info.value) and "block 1" in str(info.value)


def test_gpt_oss_block_shape_accepted():
    packed, scales = _random_mxfp4(8, 64)
    w = q.dequant_mxfp4(packed, scales)
    assert torch.equal(q.dequant_mxfp4(packed.view(8, 2, 16), scales), w)
    x = torch.randn(3, 64)
    torch.testing.assert_close(q.mxfp4_linear(x, packed.view(8, 2, 16), scales), x @ w.T, rtol=1e-5, atol=1e-4)


def test_gguf_layout():
    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    blocks = codes.view(5, 2, 32)
    packed = (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(5, 32)  # elements j, j+16 share byte j
    scales = torch.tensor([[126, 129]] * 5, dtype=torch.uint8)
    want = q.E2M1_VALUES[codes.long()] * torch.tensor([0.5, 4.0]).repeat_interleave(32)
    assert torch.equal(q.dequant_mxfp4(packed, scales, layout="gguf"), want)
    x = torch.randn(3, 64)
    _assert_matmul_close(q.mxfp4_linear(x, packed, scales, layout="gguf"), x, want)
    with pytest.raises(ValueError):
        q.dequant_mxfp4(packed, scales, layout="high_first")


# ------------------------------------------------------------------------------------------------- MXFP4 linear


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("rows_per_chunk", [None, 7, 64])
def test_mxfp4_linear_matches_dequant(tokens, rows_per_chunk):
    packed, scales = _random_mxfp4(150, 96, seed=tokens)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(1))
    w = q.dequant_mxfp4(packed, scales)
    _assert_matmul_close(q.mxfp4_linear(x, packed, scales, rows_per_chunk=rows_per_chunk), x, w)


def test_mxfp4_linear_extreme_scales_and_scratch():
    packed, _ = _random_mxfp4(40, 64)
    huge = torch.randint(241, 255, (20, 2), dtype=torch.uint8)  # 2^(s - 113) would overflow fp32
    tiny = torch.randint(0, 10, (20, 2), dtype=torch.uint8)  # 2^-127 is subnormal
    for scales, x_scale, rows in ((torch.cat([huge, tiny]), 2.0 ** -120, slice(0, 20)),
                                  (torch.cat([tiny, tiny]), 2.0 ** 120, slice(0, 40))):
        x = torch.randn(2, 64, generator=torch.Generator().manual_seed(8)) * x_scale
        w = q.dequant_mxfp4(packed, scales)
        keep = w[rows].abs().amax(1) < torch.finfo(torch.float32).max  # 6 * 2^127 overflows fp32 already
        got = q.mxfp4_linear(x, packed, scales, scratch=torch.empty(13 * 64))
        _assert_matmul_close(got[:, rows][:, keep], x, w[rows][keep])


def test_mxfp4_linear_leading_dims_and_bad_scratch():
    packed, scales = _random_mxfp4(10, 32)
    x = torch.randn(2, 3, 32)
    got = q.mxfp4_linear(x, packed, scales)
    assert got.shape == (2, 3, 10)
    torch.testing.assert_close(got, x @ q.dequant_mxfp4(packed, scales).T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        q.mxfp4_linear(x, packed, scales, scratch=torch.empty(8))


# ------------------------------------------------------------------------------------------------- MXFP4 quantize


def test_quantize_mxfp4_round_trips_representable_weights():
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (6, 128), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (6, 4), dtype=torch.uint8, generator=g)
    w = q.E2M1_VALUES[codes.long()] * q.e8m0_to_float(scales).repeat_interleave(32, 1)
    packed, new_scales = q.quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 64) and new_scales.shape == (6, 4)
    assert torch.equal(q.dequant_mxfp4(packed, new_scales), w)


def test_quantize_mxfp4_nibble_order_and_ties():
    w = torch.zeros(1, 32)
    w[0, :6] = torch.tensor([6.0, -0.5, 0.25, 0.75, 2.5, 5.0])  # ties go to the even code
    packed, scales = q.quantize_mxfp4(w)
    assert scales.item() == 127
    assert packed[0, 0].item() == 0x97  # element 0 (6.0, code 7) low, element 1 (-0.5, code 9) high
    assert q.dequant_mxfp4(packed, scales)[0, :6].tolist() == [6.0, -0.5, 0.0, 1.0, 2.0, 4.0]


def test_quantize_mxfp4_error_bounded():
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(9)) * 0.02
    packed, scales = q.quantize_mxfp4(w)
    err = (q.dequant_mxfp4(packed, scales) - w).abs().view(16, 8, 32)
    step = q.e8m0_to_float(scales).unsqueeze(-1)  # half the widest gap (4 -> 6) times the scale
    assert (err <= step).all()
    amax = w.abs().view(16, 8, 32).amax(-1)
    assert (amax <= 6 * q.e8m0_to_float(scales)).all() and (amax > 3 * q.e8m0_to_float(scales)).all()


# ------------------------------------------------------------------------------------------------- FP8 block


def test_fp8_block_dequant_by_hand_with_partial_edges():
    w = torch.tensor([[1.0, -2.0, 0.5], [448.0, 0.0, -0.015625], [3.0, 1.5, -6.0]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[2.0, 0.5], [-1.0, 4.0]])
    got = q.dequant_fp8_block(w, scale_inv, block=(2, 2))
    want = torch.tensor([[2.0, -4.0, 0.25], [896.0, 0.0, -0.0078125], [-3.0, -1.5, -24.0]])
    assert torch.equal(got, want)


def test_fp8_block_default_block_partial_edges():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(2))
    weight, scale_inv = q.quantize_fp8_block(w)
    assert weight.dtype == torch.float8_e4m3fn and scale_inv.shape == (2, 3)
    deq = q.dequant_fp8_block(weight, scale_inv)
    assert deq[129, 257] == weight[129, 257].float() * scale_inv[1, 2]  # bottom-right partial block
    assert deq[5, 130] == weight[5, 130].float() * scale_inv[0, 1]
    assert deq[199, 0] == weight[199, 0].float() * scale_inv[1, 0]
    # e4m3 keeps 3 mantissa bits; below 2^-6 (subnormals) the step is 2^-9 times the block scale
    torch.testing.assert_close(deq, w, rtol=0.07, atol=float(scale_inv.max()) * 2.0 ** -10)
    with pytest.raises(CheckpointError):
        q.dequant_fp8_block(weight, scale_inv[:1])


@pytest.mark.parametrize("tokens", [1, 5])
def test_fp8_block_linear_matches_dequant(tokens):
    all_bytes = torch.arange(256, dtype=torch.uint8).repeat(60)[: 150 * 100].view(150, 100)
    all_bytes[all_bytes & 0x7F == 0x7F] = 0  # drop the two NaN codes
    weight = all_bytes.view(torch.float8_e4m3fn)  # every finite code, subnormals included
    scale_inv = torch.tensor([[0.5, 3.0], [2.0 ** -20, 7.0]])
    x = torch.randn(tokens, 100)
    got = q.fp8_block_linear(x, weight, scale_inv, block=(128, 64), rows_per_chunk=48)
    _assert_matmul_close(got, x, q.dequant_fp8_block(weight, scale_inv, block=(128, 64)))


# ------------------------------------------------------------------------------------------------- int4


def test_int4_unpack_hand_packed():
    # word 0: elements 0..7 = -8, 7, 0, -1, 1, 2, -3, 5 stored as value + 8, element i in bits 4i..4i+3
    stored = [0, 15, 8, 7, 9, 10, 5, 13]
    word = sum(v << (4 * i) for i, v in enumerate(stored))  # 0xD5A978F0, negative as int32
    word2 = 0x88888888 - 2**32  # eight zeros
    packed = torch.tensor([[word - 2**32, word2]], dtype=torch.int32)
    want = [-8, 7, 0, -1, 1, 2, -3, 5] + [0] * 8
    assert q.unpack_int4(packed).tolist() == [want]
    scale = torch.tensor([[0.5]], dtype=torch.bfloat16)
    got = q.dequant_int4_packed(packed, scale, group_size=16)
    assert got.tolist() == [[v * 0.5 for v in want]]
    assert q.dequant_int4_packed(packed, scale, group_size=16, shape=torch.tensor([1, 10])).shape == (1, 10)


def test_pack_int4_round_trip_and_layout():
    w = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    packed, scale = q.pack_int4(w, scale_dtype=torch.float32)
    assert packed.dtype == torch.int32 and packed.shape == (9, 8) and scale.shape == (9, 2)
    deq = q.dequant_int4_packed(packed, scale)
    assert ((deq - w).abs() <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all()
    ints = torch.randint(-7, 8, (3, 32), generator=torch.Generator().manual_seed(6)).float()
    ints[:, 0] = 7.0
    packed, scale = q.pack_int4(ints)
    assert scale.dtype == torch.bfloat16 and (scale == 1.0).all()
    assert torch.equal(q.unpack_int4(packed).float(), ints)


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_int4_linear_matches_dequant(tokens):
    w = torch.randn(70, 128, generator=torch.Generator().manual_seed(tokens))
    packed, scale = q.pack_int4(w)
    x = torch.randn(tokens, 128)
    _assert_matmul_close(q.int4_linear(x, packed, scale, rows_per_chunk=16), x, q.dequant_int4_packed(packed, scale))


def test_int4_linear_padded_and_ragged_shapes():
    w = torch.randn(6, 44)  # 44 inputs: packed to 6 words (48 slots), scales for 2 groups of 32
    packed, scale = q.pack_int4(w)
    assert packed.shape == (6, 6) and scale.shape == (6, 2)
    x = torch.randn(2, 44)
    deq = q.dequant_int4_packed(packed, scale, shape=(6, 44))
    _assert_matmul_close(q.int4_linear(x, packed, scale, shape=(6, 44)), x, deq)
    w = torch.randn(5, 60)
    packed, scale = q.pack_int4(w, group_size=16)  # 64 slots = 4 whole groups: the fast path with padding
    deq = q.dequant_int4_packed(packed, scale, group_size=16, shape=(5, 60))
    _assert_matmul_close(q.int4_linear(torch.ones(1, 60), packed, scale, 16, shape=(5, 60)), torch.ones(1, 60), deq)


# ------------------------------------------------------------------------------------------------- bandwidth


def test_bandwidth_probe_is_positive():
    rate = q.bandwidth_probe(1 << 20)  # shared CI cores: only check that it measures something
    assert math.isfinite(rate) and rate > 0
