"""Native CPU kernels (moestream.kernels.cpu): bf16 and MXFP4 matmuls match a float64 reference of the expanded
weights, the torch fallback gives the same answers, the build is cached and fails soft, callers route correctly."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import max_rel_diff, prompt_ids
from moestream.errors import CheckpointError
from moestream.experts.dispatch import Upcast
from moestream.kernels import cpu, fused, quant as q
from moestream.models import blocks

native = pytest.mark.skipif(not cpu.available(), reason=f"no native kernels here ({cpu.reason()})")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A private kernel cache; the module's load state is restored afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("MOESTREAM_NATIVE", raising=False)
    cpu.reset()
    yield tmp_path / "cache" / "moestream" / "kernels"
    monkeypatch.undo()
    cpu.reset()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float = 1e-5) -> None:
    """Against float64 x @ w^T: each output within rtol of sum_k |x_k w_k| (covers cancellation)."""
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    want = x64 @ w64.T
    bound = x64.abs() @ w64.abs().T
    got = got.reshape(want.shape).double()
    assert got.shape == want.shape
    err = (got - want).abs()
    assert bool((err <= rtol * bound + 1e-30).all()), f"max rel err {float((err / bound.clamp_min(1e-30)).max())}"


def _on_threads(fn, counts=(1, 2)) -> list:
    """fn() run with the native pool at each thread count in turn (the caller's count restored)."""
    before = cpu.threads()
    try:
        out = []
        for n in counts:
            cpu.set_threads(n)
            out.append(fn())
        return out
    finally:
        cpu.set_threads(before)


def _fp8(rows: int, cols: int, seed: int, block: tuple[int, int] = (64, 64)):
    """Random float8_e4m3fn codes (every non-NaN code, subnormals and both zeros among them) and their scale_inv."""
    g = _gen(seed)
    codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    codes[0, : min(cols, 256)] = torch.arange(min(cols, 256), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    scale_inv = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=g) * 1e-2 + 1e-4
    return codes.view(torch.float8_e4m3fn), scale_inv


def _int4(rows: int, cols: int, seed: int, scale_dtype: torch.dtype = torch.bfloat16):
    """Random int4 pack-quantized words (every nibble value in row 0) and group-of-32 scales."""
    g = _gen(seed)
    q4 = torch.randint(-8, 8, (rows, cols), generator=g)
    q4[0, : min(cols, 16)] = torch.arange(-8, 8)[: min(cols, 16)]
    scale = (torch.rand(rows, cols // 32, generator=g) * 1e-2 + 1e-4).to(scale_dtype)
    return q._pack_int32(q4), scale


def _mxfp4(rows: int, cols: int, seed: int, low: int = 110, high: int = 140):
    g = _gen(seed)
    return (torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
            torch.randint(low, high, (rows, cols // 32), dtype=torch.uint8, generator=g))


# ---------------------------------------------------------------------------------------------------- bf16


@native
@pytest.mark.parametrize("k", [1, 15, 16, 17, 33, 2048 + 8])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_bf16_matches_float64(k, n):
    w = torch.randn(n, k, generator=_gen(k * 100 + n)).bfloat16()
    for t in range(1, 18):
        x = torch.randn(t, k, generator=_gen(t))
        _assert_close(cpu.linear_bf16(x, w), x, w.float())


@native
def test_bf16_non_contiguous_and_leading_dims():
    w = torch.randn(9, 40, generator=_gen(1)).bfloat16()
    x = torch.randn(2, 3, 80, generator=_gen(2))[..., ::2]  # strided rows
    assert not x.is_contiguous()
    y = cpu.linear_bf16(x, w)
    assert y.shape == (2, 3, 9)
    _assert_close(y, x, w.float())
    wt = torch.randn(40, 9, generator=_gen(3)).bfloat16().T  # a transposed (non-contiguous) weight
    _assert_close(cpu.linear_bf16(x, wt), x, wt.float())


@native
def test_bf16_empty_and_zero_inner():
    assert cpu.linear_bf16(torch.randn(0, 8), torch.ones(3, 8, dtype=torch.bfloat16)).shape == (0, 3)
    assert torch.equal(cpu.linear_bf16(torch.randn(2, 0), torch.ones(3, 0, dtype=torch.bfloat16)), torch.zeros(2, 3))


def test_blocks_linear_native_and_fallback_agree():
    w = torch.randn(300, 130, generator=_gen(4)).bfloat16()
    b = torch.randn(300, generator=_gen(5)).bfloat16()
    for t in (1, 5, 16, 17, 40):
        x = torch.randn(t, 130, generator=_gen(t))
        auto = blocks.linear(x, w, b)
        with cpu.disabled():
            assert not cpu.bf16_native(w, x)
            fallback = blocks.linear(x, w, b)
        _assert_close(auto - b.float(), x, w.float(), rtol=2e-5)
        _assert_close(fallback - b.float(), x, w.float(), rtol=2e-5)
        assert cpu.bf16_native(w, x) == (cpu.available() and t <= cpu.MAX_TOKENS_BF16)


# --------------------------------------------------------------------------------------------------- MXFP4


@native
@pytest.mark.parametrize("layout", ["low_first", "gguf"])
@pytest.mark.parametrize("k", [32, 96, 128, 2048 + 32])
@pytest.mark.parametrize("n", [1, 5, 33])
def test_mxfp4_matches_float64(layout, k, n):
    packed, scales = _mxfp4(n, k, seed=k + n)
    w = q.dequant_mxfp4(packed, scales, layout)
    for t in range(1, 18):
        x = torch.randn(t, k, generator=_gen(t))
        _assert_close(cpu.linear_mxfp4(x, packed, scales, layout), x, w)
        if t in (1, 17):
            _assert_close(q.mxfp4_linear(x, packed, scales, layout=layout), x, w)


@native
def test_situ_glu_native_matches_float64_and_torch():
    """Kimi K3's SiTU-GLU in one native call (cpu.situ_glu, which blocks.situ_glu takes in inference): within a few
    fp32 roundings of float64 from 1e-4 to 3 in scale (both sides of the tanh's series / exponential switch), as close
    as torch's ops; specials as torch gives them; a row's values the same bits whatever its length (lanes and the
    scalar tail do the same operations) and on one or two threads; with a gradient to keep, torch's ops."""
    def ref(g, u):
        g, u = g.double(), u.double()
        return (4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g)) * (25.0 * torch.tanh(u / 25.0))

    for scale in (1e-4, 1e-2, 0.3, 1.0, 3.0):
        g, u = torch.randn(16, 3072, generator=_gen(1)) * scale, torch.randn(16, 3072, generator=_gen(2)) * scale
        want = ref(g, u)
        got = cpu.situ_glu(g, u, 4.0, 25.0).double()
        assert float(((got - want).abs() / want.abs()).max()) < 1e-6
        one, two = _on_threads(lambda: cpu.situ_glu(g, u, 4.0, 25.0))
        assert torch.equal(one, two)
    sp = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -88.0, 1e30, 0.55, -0.55])
    with torch.no_grad():
        got = blocks.situ_glu(sp, torch.ones_like(sp))
    torch_ops = (4.0 * torch.tanh(sp / 4.0) * torch.sigmoid(sp)) * (25.0 * torch.tanh(torch.ones_like(sp) / 25.0))
    assert torch.equal(got.isnan(), torch_ops.isnan())
    assert max_rel_diff(torch.nan_to_num(got), torch.nan_to_num(torch_ops)) < 1e-6
    g, u = torch.randn(1, 37, generator=_gen(3)), torch.randn(1, 37, generator=_gen(4))
    whole = cpu.situ_glu(g, u, 4.0, 25.0)
    assert torch.equal(torch.cat([cpu.situ_glu(g[:, i:i + 1], u[:, i:i + 1], 4.0, 25.0) for i in range(37)], 1), whole)
    with torch.inference_mode():
        assert torch.equal(blocks.situ_glu(g, u), whole)
    gr = g.clone().requires_grad_()
    out = blocks.situ_glu(gr, u)
    out.sum().backward()  # torch's ops: differentiable
    assert gr.grad is not None and max_rel_diff(out.detach(), whole) < 1e-5


@native
@pytest.mark.parametrize("layout", ["low_first", "gguf"])
def test_mxfp4_one_token_integer_path(layout):
    """A one-token MXFP4 product (every entry of the call at one token: a decode step's) in integers where the CPU
    has AVX-512 VNNI (`cpu.mxfp4_int`): x held per 8 inputs to within 2^-23 of their largest |x|, exact products.
    Within a few fp32 roundings of float64 even beside outliers 300x the rest, and widths whose last group of four
    blocks is short; a token holding a non-finite value or an extreme magnitude takes the fp32 tiles (the same
    bits as the same row in a two-token call); the threads give the same bits."""
    for n, k, outlier in ((37, 3584, 1.0), (33, 2048 + 96, 300.0), (5, 160, 30.0)):
        packed, scales = _mxfp4(n, k, seed=n + k, low=118, high=130)
        w = q.dequant_mxfp4(packed, scales, layout).double()
        x = torch.randn(1, k, generator=_gen(k))
        x[0, ::97] *= outlier
        x[0, 32:64] = 0.0  # a block of zeros (its lanes' scale 0)
        got = cpu.linear_mxfp4(x, packed, scales, layout).double()
        ref = x.double() @ w.T
        err = ((got - ref).abs() / (x.double().abs() @ w.abs().T)).max().item()
        assert err < 2e-6, err
        tiles = cpu.linear_mxfp4(torch.cat([x, x]), packed, scales, layout)[:1].double()
        assert torch.equal(got, tiles) != cpu.mxfp4_int()  # the integer path's own roundings, where it runs
        one, two = _on_threads(lambda: cpu.linear_mxfp4(x, packed, scales, layout, min_rows_per_thread=1))
        assert torch.equal(one, two)
    packed, scales = _mxfp4(9, 256, seed=5)
    for bad in (float("nan"), float("inf"), 1e36, 1e-36):
        x = torch.randn(1, 256, generator=_gen(6))
        x[0, 32:64] *= bad  # a whole block (the tiny one: every input of its lanes)
        got = cpu.linear_mxfp4(x, packed, scales, layout)
        tiles = cpu.linear_mxfp4(torch.cat([x, x]), packed, scales, layout)[:1]
        assert torch.equal(got.isnan(), tiles.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(tiles))


@native
@pytest.mark.parametrize("layout", ["low_first", "gguf"])
@pytest.mark.parametrize("k", [32, 96, 160, 2048 + 32])
@pytest.mark.parametrize("n", [1, 5, 33])
def test_mxfp4_bf16_is_the_rounded_inputs_product(layout, k, n):
    """The bf16 compute path's MXFP4 product (ms_linear_mxfp4_bf16): x rounded to bf16 times the exact weights, fp32
    sums, for 1-17 tokens and widths whose last group of four blocks is short (32, 96, 160: 1-3 blocks); each
    token's row is the same bits in a call of 1, 2, 3 or 9 tokens (with AVX-512 BF16; the portable path's tiles
    of 3+ tokens scale the weights first, so there within fp32 rounding); mxfp4_linear's native and torch paths
    and linear_mxfp4_many take it too."""
    packed, scales = _mxfp4(n, k, seed=k + n + 1)
    w = q.dequant_mxfp4(packed, scales, layout)
    x = torch.randn(17, k, generator=_gen(k + 3))
    rounded = x.bfloat16().float()
    whole = cpu.linear_mxfp4(x, packed, scales, layout, bf16=True)
    _assert_close(whole, rounded, w)
    for t in (1, 2, 3, 9):
        part = cpu.linear_mxfp4(x[:t], packed, scales, layout, bf16=True)
        if cpu.bf16dot():
            assert torch.equal(part, whole[:t])
        else:
            _assert_close(part, rounded[:t], w)
    _assert_close(q.mxfp4_linear(x, packed, scales, layout=layout, bf16=True), rounded, w)
    _assert_close(q.mxfp4_linear(x, packed, scales, layout=layout, native=False, bf16=True), rounded, w)
    a, b = cpu.linear_mxfp4_many([x[:4], x[:4]], [(packed, scales), (packed, scales)], layout, bf16=True)
    assert torch.equal(a, b)
    _assert_close(a, rounded[:4], w)


@native
def test_mxfp4_bf16_rounds_what_the_fp32_product_does_not():
    """The option does something: the bf16 product differs from the fp32 one and equals the fp32 product of the
    rounded inputs up to fp32 summation; threads give the same bits; a 0xFF scale byte is found first."""
    packed, scales = _mxfp4(300, 3584, seed=21, low=120, high=128)
    x = torch.randn(2, 3584, generator=_gen(22))
    exact = cpu.linear_mxfp4(x, packed, scales)
    one, two = _on_threads(lambda: cpu.linear_mxfp4(x, packed, scales, min_rows_per_thread=1, bf16=True))
    assert torch.equal(one, two)
    assert not torch.equal(one, exact)
    assert max_rel_diff(one, cpu.linear_mxfp4(x.bfloat16().float(), packed, scales)) < 1e-5
    assert 1e-5 < max_rel_diff(one, exact) < 1e-2  # bf16's rounding of x, not an error of the kernel
    bad = scales.clone()
    bad[7, 3] = 255
    out = torch.empty(2, 300)
    xs, ts = [x.data_ptr()] * 2, [2, 2]
    got = cpu.linear_mxfp4_ptrs(xs, ts, [packed.data_ptr()] * 2, [scales.data_ptr(), bad.data_ptr()],
                                [out.data_ptr()] * 2, 300, 3584, bf16=True)
    assert got == 1


@native
def test_mxfp4_non_contiguous_x_and_many():
    packed, scales = _mxfp4(6, 64, seed=1)
    other = _mxfp4(6, 64, seed=2)
    w, w2 = q.dequant_mxfp4(packed, scales), q.dequant_mxfp4(*other)
    x = torch.randn(3, 128, generator=_gen(3))[:, ::2]
    _assert_close(q.mxfp4_linear(x, packed, scales), x, w)
    x1 = torch.randn(4, 64, generator=_gen(4))
    a, b, c = cpu.linear_mxfp4_many([x1, x1, torch.zeros(0, 64)], [(packed, scales), other, other])
    _assert_close(a, x1, w)
    _assert_close(b, x1, w2)
    assert c.shape == (0, 6)


@native
@pytest.mark.parametrize("layout", ["low_first", "gguf"])
def test_mxfp4_all_nibble_codes_both_positions(layout):
    codes = torch.arange(16, dtype=torch.uint8)
    rows = []
    for position in (0, 1):  # code in the low nibble, then in the high nibble, the other nibble all 16 codes
        for c in range(16):
            byte = (codes << 4) | c if position == 0 else (torch.full_like(codes, c) << 4) | codes
            rows.append(byte)
    packed = torch.stack(rows)  # [32, 16]: one block per row
    scales = torch.full((32, 1), 127, dtype=torch.uint8)
    w = q.dequant_mxfp4(packed, scales, layout)
    eye = torch.eye(32)  # one-hot inputs: each output is a single exact product
    got = cpu.linear_mxfp4(eye, packed, scales, layout)
    assert torch.equal(got.T, w)
    assert sorted(set(w.flatten().tolist())) == sorted(set(q.E2M1_VALUES.tolist()))


@native
@pytest.mark.parametrize("layout", ["low_first", "gguf"])
def test_mxfp4_every_scale_byte(layout):
    packed = _mxfp4(255, 64, seed=7)[0]
    s = torch.arange(255, dtype=torch.uint8)
    scales = torch.stack([s, s.flip(0)], dim=1)  # every byte 0..254 in both blocks
    w = q.dequant_mxfp4(packed, scales, layout)
    finite = torch.isfinite(w).all(1)  # 2^127 * 2 and more overflow fp32 in the reference already
    x = torch.randn(3, 64, generator=_gen(8))
    for x_scale, rows in ((2.0 ** -120, finite & (w.abs().amax(1) > 2.0 ** 60)), (2.0 ** 120, w.abs().amax(1) < 2.0)):
        xs = x * x_scale
        got = q.mxfp4_linear(xs, packed, scales, layout=layout)
        _assert_close(got[:, rows], xs, w[rows])
        one = cpu.linear_mxfp4(xs[:1], packed, scales, layout)  # one token: the scale applied to block sums
        _assert_close(one[:, rows], xs[:1], w[rows])
    assert int(finite.sum()) >= 250


@native
def test_mxfp4_scale_255_raises_like_torch_path():
    packed, scales = _mxfp4(4, 64, seed=9)
    scales[2, 1] = 255
    x = torch.randn(1, 64)
    with pytest.raises(CheckpointError) as native_err:
        q.mxfp4_linear(x, packed, scales, name="w")
    with pytest.raises(CheckpointError) as torch_err:
        q.mxfp4_linear(x, packed, scales, name="w", native=False)
    assert str(native_err.value) == str(torch_err.value)
    assert "row 2, block 1" in str(native_err.value)


def test_mxfp4_native_and_fallback_agree():
    packed, scales = _mxfp4(70, 96, seed=10)
    for t in (1, 8, 16, 70):
        x = torch.randn(t, 96, generator=_gen(t))
        auto = q.mxfp4_linear(x, packed, scales)
        with cpu.disabled():
            assert not q.mxfp4_native(t)
            fallback = q.mxfp4_linear(x, packed, scales)
        plain = q.mxfp4_linear(x, packed, scales, native=False)
        w = q.dequant_mxfp4(packed, scales)
        _assert_close(auto, x, w)
        _assert_close(fallback, x, w)
        assert torch.equal(fallback, plain)


# ---------------------------------------------------------------------------------------------- build, env


def test_env_var_turns_native_off(fresh_cache, monkeypatch):
    monkeypatch.setenv("MOESTREAM_NATIVE", "0")
    cpu.reset()
    assert not cpu.available()
    assert "MOESTREAM_NATIVE=0" in cpu.reason()
    w = torch.randn(5, 40, generator=_gen(11)).bfloat16()
    x = torch.randn(2, 40)
    _assert_close(blocks.linear(x, w), x, w.float())
    packed, scales = _mxfp4(5, 64, seed=12)
    x = torch.randn(2, 64)
    _assert_close(q.mxfp4_linear(x, packed, scales), x, q.dequant_mxfp4(packed, scales))
    assert not fresh_cache.exists()  # nothing was built


def test_missing_gcc_falls_back(fresh_cache, monkeypatch):
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    assert not cpu.available()
    assert cpu.reason().startswith("native kernels off:") and "gcc" in cpu.reason()
    assert "\n" not in cpu.reason()
    w = torch.randn(5, 40, generator=_gen(13)).bfloat16()
    x = torch.randn(2, 40)
    _assert_close(blocks.linear(x, w), x, w.float())


def test_failed_build_falls_back(fresh_cache, monkeypatch):
    monkeypatch.setattr(cpu, "FLAGS", ("-O2", "-fPIC", "-shared", "-no-such-flag-xyz"))
    if cpu.shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    assert not cpu.available()
    assert "gcc failed" in cpu.reason()
    assert not list(fresh_cache.glob("*.so")) and not list(fresh_cache.glob("*.tmp"))


def test_portable_build_is_cached_and_correct(fresh_cache, monkeypatch):
    """The scalar code (no -march=native): built once into the cache dir, then loaded from there."""
    if cpu.shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    monkeypatch.setattr(cpu, "FLAGS", ("-O2", "-fPIC", "-shared", "-pthread"))
    assert cpu.available(), cpu.reason()
    assert not cpu.simd()
    built = cpu.library_path()
    assert built.parent == fresh_cache and built.exists()
    stamp = built.stat().st_mtime_ns
    cpu.reset()
    assert cpu.available() and built.stat().st_mtime_ns == stamp  # reused, not rebuilt
    w = torch.randn(7, 33, generator=_gen(14)).bfloat16()
    for t in (1, 9):
        x = torch.randn(t, 33, generator=_gen(t))
        _assert_close(cpu.linear_bf16(x, w), x, w.float())
    for layout in ("low_first", "gguf"):
        packed, scales = _mxfp4(5, 64, seed=15)
        x = torch.randn(3, 64)
        _assert_close(cpu.linear_mxfp4(x, packed, scales, layout), x, q.dequant_mxfp4(packed, scales, layout))
    codes, scale_inv = _fp8(130, 192, seed=16)
    for t in (1, 3):  # the portable path's lookup table, every code the rows hold
        x = torch.randn(t, 192, generator=_gen(t))
        _assert_close(cpu.linear_fp8(x, codes, scale_inv, (64, 64)), x, q.dequant_fp8_block(codes, scale_inv, (64, 64)))
        packed, scale = _int4(9, 96, seed=t)
        _assert_close(cpu.linear_int4(x[:, :96], packed, scale), x[:, :96], q.dequant_int4_packed(packed, scale))


def test_cache_key_depends_on_flags(monkeypatch):
    a = cpu.library_path()
    monkeypatch.setattr(cpu, "FLAGS", ("-O2",))
    assert cpu.library_path() != a and cpu.library_path().parent == a.parent


@native
def test_threads_give_the_same_answers():
    w = torch.randn(1001, 64, generator=_gen(16)).bfloat16()
    packed, scales = _mxfp4(1001, 64, seed=17)
    x = torch.randn(3, 64)
    before = cpu.threads()
    try:
        cpu.set_threads(1)
        one = cpu.linear_bf16(x, w, min_rows_per_thread=1), cpu.linear_mxfp4(x, packed, scales, min_rows_per_thread=1)
        cpu.set_threads(2)
        assert cpu.threads() == 2
        two = cpu.linear_bf16(x, w, min_rows_per_thread=1), cpu.linear_mxfp4(x, packed, scales, min_rows_per_thread=1)
    finally:
        cpu.set_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@native
@pytest.mark.parametrize("rows", [1001, 3072, 40])
def test_one_token_rows_in_shrinking_chunks_give_one_threads_sums(rows):
    """A one-token product splits its rows into chunks that shrink from long runs (bf16_run's guided schedule):
    each row's sum is the one thread's, for bf16 and b12-coded rows (some stored whole, some with exceptions)."""
    from moestream.kernels import b12

    w = torch.randn(rows, 128, generator=_gen(18)).bfloat16()
    w[5, 7] = 0.0  # a row stored whole (plain b12) or with an exception (b12x)
    coded = [b12.B12Weight.wrap(b12.encode(w, exceptions=x), (rows, 128)) for x in (False, True)]
    x = torch.randn(1, 128)
    before = cpu.threads()
    try:
        got = []
        for n in (1, 2):
            cpu.set_threads(n)
            got.append(cpu.linear_bf16_many(x, [w, *coded], min_rows_per_thread=1))
    finally:
        cpu.set_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*got))
    assert torch.equal(got[1][0], got[1][1]) and torch.equal(got[1][0], got[1][2])  # the codings' sums are bf16's


# ------------------------------------------------------------------------------------------------- callers


def test_upcast_skips_bf16_experts_the_native_kernel_takes():
    tensors = {"gate": torch.randn(8, 16).bfloat16(), "down": torch.randn(16, 8).bfloat16()}
    up = Upcast()
    small = up(tensors, tokens=1)
    big = up(tensors, tokens=cpu.MAX_TOKENS_BF16 + 1)
    assert big["gate"].dtype == torch.float32
    if cpu.available():
        assert small is tensors
    else:
        assert small["gate"].dtype == torch.float32
    with cpu.disabled():
        assert up(tensors, tokens=1)["down"].dtype == torch.float32
    f16 = {"gate": torch.randn(8, 16).half()}
    assert up(f16, tokens=1)["gate"].dtype == torch.float32  # no native f16 kernel: expanded as before
    assert math.isclose(float(up(tensors)["gate"][0, 0]), float(tensors["gate"][0, 0]))


@native
def test_model_native_and_torch_paths_agree(tmp_path):
    """The kimi_k3 synthetic model (bf16 dense weights, MXFP4 experts, grouped and per-expert paths): same logits
    with the native kernels as with the torch paths, for a prefill and for decode steps of several sequences."""
    from moestream import Engine
    from moestream.synth import synthesize

    synthesize("kimi_k3", tmp_path / "k3", "tiny", progress=False)
    ids = prompt_ids(256, 24, seed=0)

    def run():
        eng = Engine.open(tmp_path / "k3")
        outs = [eng.logits(ids), eng.logits(ids)]  # cold (per-expert), then warm (grouped)
        seqs = [eng.new_sequence() for _ in range(3)]
        for i, s in enumerate(seqs):
            eng.step([(s, ids[i * 4:(i + 1) * 4])])
        for t in range(3):
            outs += eng.step([(s, [ids[t * 3 + i]]) for i, s in enumerate(seqs)])
        return outs

    auto = run()
    with cpu.disabled():
        plain = run()
    assert len(auto) == len(plain) == 11
    for a, b in zip(auto, plain):
        assert max_rel_diff(a, b) < 1e-4


def test_concurrent_builds_leave_one_good_library(fresh_cache, monkeypatch):
    """Two builders of the same library at once (threads here, processes in real life): each writes its own
    temporary file and renames it into place, so the result loads and no temporary is left behind."""
    import threading

    if cpu.shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    monkeypatch.setattr(cpu, "FLAGS", ("-O1", "-fPIC", "-shared", "-pthread"))
    target = cpu.library_path()
    errors = []

    def build():
        try:
            cpu._build(target)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [p.name for p in fresh_cache.iterdir()] == [target.name]
    assert cpu.available() and not cpu.simd()


_FORK_ARGS: list = []  # made in the parent: torch's own OpenMP pool may hang a forked child that starts it


def _child_linear(queue) -> None:
    x, w = _FORK_ARGS
    queue.put(cpu.linear_bf16(x, w, min_rows_per_thread=1).tolist())


@native
def test_pool_works_in_a_forked_child():
    """A child forked after the pool started its worker has no worker: it starts its own instead of hanging."""
    import multiprocessing

    x, w = torch.ones(1, 64), torch.ones(600, 64, dtype=torch.bfloat16)
    _FORK_ARGS[:] = [x, w]
    before = cpu.threads()
    cpu.set_threads(2)
    try:
        cpu.linear_bf16(x, w, min_rows_per_thread=1)  # the parent's worker exists now
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_child_linear, args=(queue,))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert queue.get(timeout=5) == [[64.0] * 600]
    finally:
        cpu.set_threads(before)
        _FORK_ARGS.clear()


def test_autograd_inputs_keep_the_torch_path():
    x = torch.randn(2, 64, requires_grad=True)
    w = torch.randn(4, 64).bfloat16()
    assert not cpu.bf16_native(w, x)
    blocks.linear(x, w).sum().backward()
    assert x.grad is not None


# ---- KDA decode: conv window step and delta-rule step, in place, vs the torch recurrence ------------------------
@native
@pytest.mark.parametrize("b,h,dk,dv", [(1, 2, 8, 8), (3, 4, 16, 24), (8, 2, 64, 64)])
def test_kda_decode_matches_torch_recurrence(b, h, dk, dv):
    from moestream.models.kda import kda_recurrent

    g = torch.Generator().manual_seed(b * 100 + dk)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v, beta = r(b, h, dk) * 0.3, r(b, h, dk) * 0.3, r(b, h, dv), torch.rand(b, h, generator=g)
    decay = -torch.rand(b, h, dk, generator=g) * 3
    states = [r(h, dk, dv) for _ in range(b)]
    want = [kda_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay[i:i + 1], beta[i:i + 1], states[i])
            for i in range(b)]
    out = cpu.kda_decode(states, q, k, v, decay, beta)
    for i in range(b):
        torch.testing.assert_close(out[i], want[i][0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[i], want[i][1], rtol=1e-5, atol=1e-5)  # updated in place


@native
@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_conv_decode_matches_unfolded_conv(kernel):
    g = torch.Generator().manual_seed(kernel)
    c, b = 37, 3
    taps = torch.randn(c, kernel, generator=g).bfloat16()
    windows = [torch.randn(kernel - 1, c, generator=g) for _ in range(b)]
    xs = [torch.randn(c, generator=g) for _ in range(b)]
    seqs = [torch.cat([w, x[None]]) for w, x in zip(windows, xs)]  # [K, C]: the window, then the new token
    want = torch.stack([(s.T * taps.float()).sum(-1) for s in seqs])
    got = cpu.conv_decode(windows, xs, taps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for w, s in zip(windows, seqs):
        assert torch.equal(w, s[1:])  # shifted by one, the new token last


@native
def test_glu_experts_of_dozens_of_rows_run_from_stored_bytes():
    """Any number of routed rows of a bf16 GLU expert is added into the step's output by the fused kernel
    straight from its stored bytes (the converted-weights GEMM path for 8+ rows, odd counts and widths included):
    fp32-reference results, only for the rows routed to it."""
    fn = blocks.expert_glu()
    g = _gen(21)
    t = {"gate": torch.randn(24, 70, generator=g).bfloat16(), "up": torch.randn(24, 70, generator=g).bfloat16(),
         "down": torch.randn(37, 24, generator=g).bfloat16()}
    ref = {k: v.float() for k, v in t.items()}
    for T in (3, 16, 40, 512):
        x = torch.randn(T, 70, generator=g)
        ids = torch.randint(0, 4, (T, 2), generator=g)
        ids[:, 1] = (ids[:, 0] + 1) % 4  # two distinct experts per row
        wts = torch.rand(T, 2, generator=g)
        rows, slots = torch.nonzero(ids == 2, as_tuple=True)
        out = torch.zeros(T, 37)
        assert fn.accumulate(x, ids, wts, 2, rows.numel(), t, out)
        want = torch.zeros(T, 37)
        want[rows] = wts[rows, slots].unsqueeze(-1) * blocks.glu_mlp(x[rows], ref["gate"], ref["up"], ref["down"])
        assert max_rel_diff(out, want) < 1e-5
    out = torch.zeros(4, 37)
    assert not fn.accumulate(torch.randn(4, 70), ids[:4], wts[:4], 2, 2, ref, out)  # fp32 weights: not its kernel
    assert out.abs().sum() == 0


@native
def test_glu_calls_split_to_fit_their_scratch_with_the_same_sums():
    """A step routing more rows than one expert's fp32 size of kernel scratch holds is split into calls over
    consecutive experts, and an expert too large alone into token ranges: every call fits the cap, and the sums
    are bit for bit those of one unsplit call (experts are added in the same order, tokens independently)."""
    g = _gen(23)
    n_exp, inter, k_in, d_out = 6, 24, 70, 37
    w = [{"gate": torch.randn(inter, k_in, generator=g).bfloat16(), "up": torch.randn(inter, k_in, generator=g).bfloat16(),
          "down": torch.randn(d_out, inter, generator=g).bfloat16()} for _ in range(n_exp)]
    parts = [(e["gate"].data_ptr(), e["up"].data_ptr(), e["down"].data_ptr()) for e in w]
    experts = list(range(n_exp))
    cap = fused.glu_scratch_cap(inter, k_in, d_out)
    for T, skew in ((700, False), (700, True), (5, False)):
        x = torch.randn(T, k_in, generator=g)
        ids = torch.stack([torch.randperm(n_exp, generator=g)[:3] for _ in range(T)])
        if skew:  # one expert takes every row (a row's experts stay distinct): alone it needs token ranges
            others = torch.tensor([0, 1, 2, 3, 5])
            ids = torch.stack([torch.cat([torch.tensor([4]), others[torch.randperm(5, generator=g)[:2]]])
                               for _ in range(T)])
        wts = torch.rand(T, 3, generator=g)
        counts = fused._pair_counts(experts, ids, T)
        groups = fused._expert_groups(counts, inter, k_in, cap)
        assert [e for grp in groups for e in grp] == [e for e in experts if counts[e]]
        for grp in groups:
            if len(grp) > 1:
                assert fused.glu_call_scratch([counts[e] for e in grp], inter, k_in) <= cap
            else:
                for lo, hi in fused._token_ranges(grp[0], ids, T, counts[grp[0]], inter, k_in, cap):
                    sub = fused._pair_counts([grp[0]], ids[lo:hi], hi - lo)
                    assert fused.glu_call_scratch(sub, inter, k_in) <= cap
        split, whole = torch.zeros(T, d_out), torch.zeros(T, d_out)
        fused.moe_glu_bf16(x, experts, parts, inter, split, ids, wts)
        fused._GluCall(experts, parts, inter, k_in, d_out, "silu", 0.0, 0.0)(range(n_exp), x, ids, wts, whole)
        assert torch.equal(split, whole)
        # the counts a caller already knows (the runner's Routing) split the call the same way
        known = torch.zeros(T, d_out)
        fused.moe_glu_bf16(x, experts, parts, inter, known, ids, wts, counts=counts)
        assert torch.equal(known, whole)
        with pytest.raises(ValueError, match="counts"):
            fused.moe_glu_bf16(x, experts, parts, inter, known, ids, wts, counts=counts[:-1])
        if T > 100:
            assert len(groups) > 1 or fused.glu_call_scratch(counts, inter, k_in) > cap
        ref = torch.zeros(T, d_out)
        for e in experts:
            rows, slots = torch.nonzero(ids == e, as_tuple=True)
            ref[rows] += wts[rows, slots].unsqueeze(-1) * blocks.glu_mlp(
                x[rows], w[e]["gate"].float(), w[e]["up"].float(), w[e]["down"].float())
        assert max_rel_diff(split, ref) < 1e-5
    # without ids: every token through every expert, split by tokens the same way
    x = torch.randn(400, k_in, generator=g)
    split, whole = torch.zeros(400, d_out), torch.zeros(400, d_out)
    fused.moe_glu_bf16(x, [0], parts[:1], inter, split)
    fused._GluCall([0], parts[:1], inter, k_in, d_out, "silu", 0.0, 0.0)([0], x, None, None, whole)
    assert fused.glu_call_scratch([400], inter, k_in) > cap and torch.equal(split, whole)


@native
def test_a_short_prefill_over_many_experts_is_one_glu_call(monkeypatch):
    """A 16-row step routed top-8 over 24 experts (2-11 rows each, none on the panel kernel) fits one native call:
    the scratch bound counts a panel's padding only for experts that can take the panel kernel (the old bound
    counted one per expert and split this step into several calls). The sums are the reference's."""
    g = _gen(29)
    n_exp, inter, k_in, d_out, T = 24, 512, 512, 48, 16
    w = [{n: (torch.randn(*shape, generator=g) * 0.05).bfloat16() for n, shape in
          (("gate", (inter, k_in)), ("up", (inter, k_in)), ("down", (d_out, inter)))} for _ in range(n_exp)]
    parts = [(e["gate"].data_ptr(), e["up"].data_ptr(), e["down"].data_ptr()) for e in w]
    x = torch.randn(T, k_in, generator=g)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:8] for _ in range(T)])
    wts = torch.rand(T, 8, generator=g)
    counts = fused._pair_counts(list(range(n_exp)), ids, T)
    assert max(counts) < 16 and len(fused._expert_groups(counts, inter, k_in, fused.glu_scratch_cap(inter, k_in, d_out))) == 1
    calls = []
    handle = cpu.required()

    class Counting:
        def __getattr__(self, name):
            return getattr(handle, name)

        def ms_moe_glu_bf16(self, *args):
            calls.append(args[0])
            return handle.ms_moe_glu_bf16(*args)

    monkeypatch.setattr(cpu, "_lib", Counting())
    out = torch.zeros(T, d_out)
    fused.moe_glu_bf16(x, list(range(n_exp)), parts, inter, out, ids, wts)
    assert calls == [n_exp]
    ref = torch.zeros(T, d_out)
    for e in range(n_exp):
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        ref[rows] += wts[rows, slots].unsqueeze(-1) * blocks.glu_mlp(
            x[rows], w[e]["gate"].float(), w[e]["up"].float(), w[e]["down"].float())
    assert max_rel_diff(out, ref) < 1e-5


@native
def test_bf16_rows_do_not_depend_on_the_row_count():
    """Each output of the multi-row bf16 kernel (2-15 rows: the token tiles) is the same fp32 sum whatever the row
    count and the rows' grouping into register tiles, so a row computed in a call of 2 rows and in one of 15 agree
    bit for bit (the kernel's rows per register block only schedule the same sums)."""
    g = _gen(31)
    w = torch.randn(70, 1000, generator=g).bfloat16()
    x = torch.randn(15, 1000, generator=g)
    whole = cpu.linear_bf16(x, w)
    for lo in range(0, 14):
        for n in (2, 3, 5, 8, 9):
            if lo + n <= 15:
                assert torch.equal(cpu.linear_bf16(x[lo:lo + n], w), whole[lo:lo + n])
    assert max_rel_diff(whole, x @ w.float().T) < 1e-5


@native
def test_a_batched_step_does_not_expand_bf16_glu_experts(tmp_path):
    """A multi-row step over a bf16 GLU model: every expert runs from its stored bytes (the runner's fp32 upcast
    buffer is never used) and the logits match the same step with the native kernels off."""
    from moestream.engine.engine import Engine
    from moestream.synth import synthesize
    synthesize("qwen3_moe", tmp_path / "q", "tiny", progress=False)
    eng = Engine.open(tmp_path / "q")
    prompts = [prompt_ids(eng.vocab_size, 30, seed=i) for i in range(4)]
    got = eng.step([(eng.new_sequence(), p) for p in prompts])
    assert eng.runner.upcast.buf.numel() == 0
    with cpu.disabled():
        ref = Engine.open(tmp_path / "q")
        want = ref.step([(ref.new_sequence(), p) for p in prompts])
    assert ref.runner.upcast.buf.numel() > 0
    for a, b in zip(got, want):
        assert max_rel_diff(a, b) < 1e-4


# ---------------------------------------------------------------------------------------------------- block FP8


@native
@pytest.mark.parametrize("n,k,block", [(1, 64, (128, 128)), (300, 448, (128, 128)), (257, 1024, (128, 64)),
                                       (130, 16384, (128, 128)), (64, 128, (32, 64))])
def test_fp8_native_is_the_block_product(n, k, block):
    """The codes read as stored: within fp32 summation of float64 over the dequantised weight (every code, the
    subnormals exact, partial row and column blocks); a token's row the same bits in calls of 1-15 tokens."""
    codes, scale_inv = _fp8(n, k, seed=n + k, block=block)
    w = q.dequant_fp8_block(codes, scale_inv, block)
    x = torch.randn(15, k, generator=_gen(k))
    alone = cpu.linear_fp8(x[:1], codes, scale_inv, block)
    for t in (1, 2, 3, 4, 5, 9, 15):
        got = cpu.linear_fp8(x[:t], codes, scale_inv, block)
        _assert_close(got, x[:t], w)
        assert torch.equal(got[0], alone[0])


@native
def test_fp8_subnormal_codes_stay_exact_under_flush_denormal():
    """The kernel widens a code through fp32 subnormals: it clears DAZ for its call, so a caller that set
    torch.set_flush_denormal(True) gets the same bits (and its setting back)."""
    codes = torch.tensor([[b for b in range(1, 8)] * 9 + [0x81] * 8 + [0] * 57], dtype=torch.uint8)
    codes = codes.view(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[1.0]])
    x = torch.ones(1, 128)
    want = cpu.linear_fp8(x, codes, scale_inv, (128, 128))
    assert float(want) == pytest.approx(sum(range(1, 8)) * 9 * 2.0 ** -9 - 8 * 2.0 ** -9, abs=0)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        assert torch.equal(cpu.linear_fp8(x, codes, scale_inv, (128, 128)), want)
        assert float(torch.tensor([1e-40]) * 1.0) == 0.0  # the caller's setting is still in force
    finally:
        torch.set_flush_denormal(False)


@native
def test_fp8_block_linear_takes_the_native_kernel_for_few_rows(monkeypatch):
    """fp8_block_linear: fewer than FP8_NATIVE_MAX_T rows on the native kernel, more (or a width it does not take)
    on the chunked torch path, both within fp32 summation of float64; threads give the same bits."""
    codes, scale_inv = _fp8(200, 256, seed=21, block=(128, 128))
    w = q.dequant_fp8_block(codes, scale_inv)
    calls = []
    real = cpu.linear_fp8
    monkeypatch.setattr(cpu, "linear_fp8", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for t in (1, 7, q.FP8_NATIVE_MAX_T - 1, q.FP8_NATIVE_MAX_T, q.FP8_NATIVE_MAX_T + 9):
        x = torch.randn(2, t, 256, generator=_gen(t))  # leading dims kept
        got = q.fp8_block_linear(x[0], codes, scale_inv)
        _assert_close(got, x[0], w)
        assert got.shape == (t, 200)
    assert calls == [1, 7, q.FP8_NATIVE_MAX_T - 1]
    odd, odd_scale = _fp8(10, 96, seed=22, block=(128, 128))  # 96 columns: not a multiple of 64
    x = torch.randn(1, 96)
    _assert_close(q.fp8_block_linear(x, odd, odd_scale), x, q.dequant_fp8_block(odd, odd_scale))
    assert calls == [1, 7, q.FP8_NATIVE_MAX_T - 1]
    with pytest.raises(ValueError, match="multiples of 64"):
        cpu.linear_fp8(x, odd, odd_scale, (128, 128))
    x = torch.randn(2, 256, generator=_gen(23))
    one, two = _on_threads(lambda: cpu.linear_fp8(x, codes, scale_inv, (128, 128), min_rows_per_thread=1))
    assert torch.equal(one, two)


# ---------------------------------------------------------------------------------------------------- int4


@native
@pytest.mark.parametrize("n,k", [(1, 32), (17, 96), (300, 448), (129, 7168)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_int4_native_is_the_group_product(n, k, scale_dtype):
    """The packed words read as stored: within fp32 summation of float64 over the dequantised weight (every nibble
    value, bf16 or fp32 group scales); a token's row the same bits in calls of 1-9 tokens."""
    packed, scale = _int4(n, k, seed=n + k, scale_dtype=scale_dtype)
    w = q.dequant_int4_packed(packed, scale)
    x = torch.randn(9, k, generator=_gen(k))
    alone = cpu.linear_int4(x[:1], packed, scale)
    for t in (1, 2, 3, 4, 5, 9):
        got = cpu.linear_int4(x[:t], packed, scale)
        _assert_close(got, x[:t], w)
        assert torch.equal(got[0], alone[0])


@native
def test_int4_linear_takes_the_native_kernel_for_few_rows(monkeypatch):
    """int4_linear: fewer than INT4_NATIVE_MAX_T rows of groups of 32 on the native kernel; more rows, another group
    size or a padded last word on the chunked torch path; all within fp32 summation of float64; threads give the
    same bits."""
    packed, scale = _int4(70, 256, seed=31)
    w = q.dequant_int4_packed(packed, scale)
    calls = []
    real = cpu.linear_int4
    monkeypatch.setattr(cpu, "linear_int4", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for t in (1, 6, q.INT4_NATIVE_MAX_T - 1, q.INT4_NATIVE_MAX_T):
        x = torch.randn(t, 256, generator=_gen(t))
        _assert_close(q.int4_linear(x, packed, scale, 32), x, w)
    assert calls == [1, 6, q.INT4_NATIVE_MAX_T - 1]
    p64, s64 = q.pack_int4(torch.randn(8, 256, generator=_gen(32)), group_size=64)
    x = torch.randn(2, 256)
    _assert_close(q.int4_linear(x, p64, s64, 64), x, q.dequant_int4_packed(p64, s64, 64))
    ragged, rscale = q.pack_int4(torch.randn(8, 100, generator=_gen(33)), group_size=32)  # 100 of 104 stored
    x = torch.randn(2, 100)
    _assert_close(q.int4_linear(x, ragged, rscale, 32, (8, 100)), x, q.dequant_int4_packed(ragged, rscale, 32, (8, 100)))
    assert calls == [1, 6, q.INT4_NATIVE_MAX_T - 1]
    with pytest.raises(ValueError, match="int32 packed"):
        cpu.linear_int4(torch.randn(1, 256), packed, scale.half())
    x = torch.randn(3, 256, generator=_gen(34))
    one, two = _on_threads(lambda: cpu.linear_int4(x, packed, scale, min_rows_per_thread=1))
    assert torch.equal(one, two)


@native
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_entry_calls_are_the_single_products(fmt):
    """linear_fp8_ptrs / linear_int4_ptrs (the grouped expert calls): each entry's rows the same bits as its own
    single call gives them, whatever the other entries' token counts, at one and two threads."""
    n, k = 96, 192
    weights = [_fp8(n, k, seed=40 + e) if fmt == "fp8" else _int4(n, k, seed=40 + e) for e in range(4)]
    tokens = [1, 3, 0, 6]
    xs = [torch.randn(t, k, generator=_gen(50 + t)) for t in tokens]
    single = cpu.linear_fp8 if fmt == "fp8" else cpu.linear_int4
    args = (((64, 64),) if fmt == "fp8" else ())
    want = [single(x, *w, *args) for x, w in zip(xs, weights)]

    def grouped():
        outs = [torch.full((t, n), float("nan")) for t in tokens]
        ptrs = ([x.data_ptr() for x in xs], tokens, [w[0].data_ptr() for w in weights],
                [w[1].data_ptr() for w in weights])
        if fmt == "fp8":
            cpu.linear_fp8_ptrs(*ptrs, [o.data_ptr() for o in outs], n, k, (64, 64), min_rows_per_thread=1)
        else:
            cpu.linear_int4_ptrs(*ptrs, True, [o.data_ptr() for o in outs], n, k, min_rows_per_thread=1)
        return outs

    for outs in _on_threads(grouped):
        for got, exp in zip(outs, want):
            assert torch.equal(got, exp)
    with pytest.raises(ValueError, match="multiple"):
        if fmt == "fp8":
            cpu.linear_fp8_ptrs([0], [1], [0], [0], [0], n, 96, (64, 64))
        else:
            cpu.linear_int4_ptrs([0], [1], [0], [0], True, [0], n, 48)
