"""The opt-in bf16 compute path (--compute-dtype bf16, kernels/_cpu_bf16.c): the native products against float64
references of the bf16-rounded inputs, each row independent of the others and of the thread count, the portable
build (no AVX-512 BF16) against the same reference, whole models within the stated bound of fp32 with the same
greedy tokens, the scratch charged, and the option validated."""
from __future__ import annotations

import contextlib
import ctypes
import math
import shutil
import subprocess

import pytest
import torch

from conftest import decode_logits, prompt_ids, seeded
from moestream import Engine
from moestream.errors import MoestreamError
from moestream.kernels import cpu, fused, quant
from moestream.memory.accountant import MemoryAccountant
from moestream.models import blocks
from moestream.synth import synthesize

native = pytest.mark.skipif(not cpu.available(), reason=f"no native kernels here ({cpu.reason()})")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _rounded_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double() @ w.double().T


@native
@pytest.mark.parametrize("t,k,n", [(1, 2, 1), (5, 6, 7), (16, 64, 40), (33, 130, 9), (70, 256, 300)])
def test_linear_is_the_bf16_rounded_product(t, k, n):
    """Against the float64 product of the bf16-rounded rows: only fp32 summation error (a kernel that forgot the
    rounding would be ~1e-3 off, see the second assertion; one that mixed up pairs or lanes far more)."""
    g = seeded(t * 1000 + k)
    x, w = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g).bfloat16()
    (y,) = cpu.linear_bf16dot_many(x, [w])
    assert y.dtype == torch.float32 and y.shape == (t, n)
    assert _rel(y, _rounded_reference(x, w)) < 1e-5
    if k >= 64:  # the rounding is there: the unrounded product is further off than fp32 sums can explain
        assert _rel(y, x.double() @ w.double().T) > 1e-4


@native
def test_rows_independent_of_split_and_threads(threads):
    """Each output row depends on its own input row only: bit-identical whether rows come in one call or one by
    one, on 1 or 2 threads, and for several weights in one call or apart."""
    g = seeded(3)
    x = torch.randn(45, 128, generator=g)
    ws = [torch.randn(n, 128, generator=g).bfloat16() for n in (64, 24)]
    threads(2)
    both = cpu.linear_bf16dot_many(x, ws)
    threads(1)
    for w, y in zip(ws, both):
        assert torch.equal(cpu.linear_bf16dot_many(x, [w])[0], y)
        assert torch.equal(torch.cat([cpu.linear_bf16dot_many(x[i:i + 1], [w])[0] for i in range(45)]), y)
        assert torch.equal(torch.cat([cpu.linear_bf16dot_many(x[i:i + 17], [w])[0] for i in range(0, 45, 17)]), y)


@native
@pytest.mark.parametrize("t", [1, 16, 70])
def test_coded_weights_give_the_bf16_rows_sums(t, threads):
    """b12-coded weights (plain b12, a row stored whole, b12x with exceptions) in the bf16 product: each block of
    rows decoded into a thread's scratch, then the bf16 rows' tile: the same bits as the bf16 matrix, on 1 and 2
    threads; `blocks.linear` under bf16 compute takes it for a B12Weight (one call, not slab by slab)."""
    from moestream.kernels import b12

    g = seeded(9)
    w = (torch.randn(100, 128, generator=g) * 0.05).bfloat16()
    w[3, 5] = 0.0  # a value far below the row's largest: plain b12 stores the row whole, b12x as an exception
    coded = [b12.B12Weight.wrap(b12.encode(w, exceptions=x), (100, 128)) for x in (False, True)]
    x = torch.randn(t, 128, generator=g)
    for n in (1, 2):
        threads(n)
        want = cpu.linear_bf16dot_many(x, [w])[0]
        assert all(torch.equal(y, want) for y in cpu.linear_bf16dot_many(x, [w, *coded])[1:])
    with blocks.compute_dtype("bf16"):
        for c in coded:
            assert torch.equal(blocks.linear(x, c), blocks.linear(x, w))


def _glu_case(e: int, inter: int, k_in: int, d_out: int, t: int, k: int, seed: int):
    g = seeded(seed)
    experts = [tuple((torch.randn(*s, generator=g) * 0.2).bfloat16() for s in ((inter, k_in), (inter, k_in),
                                                                             (d_out, inter))) for _ in range(e)]
    x = torch.randn(t, k_in, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    scores = torch.rand(t, k, generator=g)
    return experts, x, ids, scores


def _glu_reference(experts, x, ids, scores) -> torch.Tensor:
    """float64 of the bf16 path's arithmetic: x rounded to bf16, SiLU-GLU, its activations rounded to bf16."""
    xr = x.bfloat16().double()
    out = torch.zeros(x.shape[0], experts[0][2].shape[0], dtype=torch.float64)
    for e, (gate, up, down) in enumerate(experts):
        h = torch.nn.functional.silu(xr @ gate.double().T) * (xr @ up.double().T)
        y = h.float().bfloat16().double() @ down.double().T
        out += ((ids == e).double() * scores.double()).sum(1, keepdim=True) * y
    return out


def _parts(experts):
    return [(g.data_ptr(), u.data_ptr(), d.data_ptr()) for g, u, d in experts]


@native
@pytest.mark.parametrize("e,inter,k_in,d_out,t,k", [(8, 64, 128, 96, 50, 2), (3, 10, 6, 14, 70, 3)])
def test_glu_matches_the_rounded_reference_and_any_split(e, inter, k_in, d_out, t, k, threads):
    experts, x, ids, scores = _glu_case(e, inter, k_in, d_out, t, k, seed=e + t)
    threads(2)
    out = torch.zeros(t, d_out)
    fused.moe_glu_bf16(x, list(range(e)), _parts(experts), inter, out, ids, scores, compute="bf16")
    assert _rel(out, _glu_reference(experts, x, ids, scores)) < 1e-5
    threads(1)
    # token ranges, and one call per expert (added in the same order), give the very same sums where each expert
    # meets the same kernel (panels, or the row kernel below ms_bf16dot_row_limit rows: a range can only have fewer)
    split = torch.zeros(t, d_out)
    for lo in range(0, t, 7):
        fused.moe_glu_bf16(x[lo:lo + 7], list(range(e)), _parts(experts), inter, split[lo:lo + 7], ids[lo:lo + 7],
                           scores[lo:lo + 7], compute="bf16")
    if not _row_kernel(inter, k_in) or all(int((ids == i).sum()) < _row_kernel(inter, k_in) for i in range(e)):
        assert torch.equal(split, out)
    assert _rel(split, _glu_reference(experts, x, ids, scores)) < 1e-5
    apart = torch.zeros(t, d_out)
    for i in range(e):
        fused.moe_glu_bf16(x, [i], _parts(experts)[i:i + 1], inter, apart, ids, scores, compute="bf16")
    assert torch.equal(apart, out)


def _row_kernel(inter: int, k_in: int) -> int:
    """rows an expert below which the bf16 GLU takes the row kernel for these widths (0: never)"""
    return cpu.lib().ms_bf16dot_row_limit() if inter % 64 == 0 and k_in % 64 == 0 else 0


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 15, 16, 17])
def test_glu_few_rows_an_expert(rows, threads):
    """An expert routed fewer than ms_bf16dot_row_limit() rows runs on the row kernel (weights in the lanes,
    _cpu_bf16.c brk_rows), from there on panels: both within 1e-5 of the bf16-rounded reference, the same bits at 1
    and 2 threads and from a b12-coded twin (a row stored whole among its rows); on the row kernel a token's result
    does not depend on the other tokens of its expert (one call a token gives the same bits)."""
    from moestream.kernels import b12
    e, inter, k_in, d_out = 3, 128, 192, 80
    t = rows * e
    experts, x, _, _ = _glu_case(e, inter, k_in, d_out, t, 1, seed=rows)
    experts[1][0][3, 5] = 0.0  # a zero among normal values: that gate row is stored whole in the coding
    experts[2][2][7, 1] = 0.0
    ids = (torch.arange(t) % e).view(t, 1)
    scores = torch.rand(t, 1, generator=seeded(rows + 100))
    coded = [tuple(b12.encode(m) for m in ex) for ex in experts]
    assert any(b12.raw_rows(m) for ex in experts for m in ex)
    outs = []
    for n in (1, 2):
        threads(n)
        for parts in (_parts(experts), [tuple(c.data_ptr() | 1 for c in ex) for ex in coded]):
            out = torch.zeros(t, d_out)
            fused.moe_glu_bf16(x, list(range(e)), parts, inter, out, ids, scores, compute="bf16")
            outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    # (1e-4: an h whose fp32 sum lies within the sums' rounding of a bf16 rounding boundary may round the other way
    # than the float64 reference's, which moves an output by ~1e-5 of the largest)
    assert _rel(outs[0], _glu_reference(experts, x, ids, scores)) < 1e-4
    alone = torch.zeros(t, d_out)
    for i in range(t):
        fused.moe_glu_bf16(x[i:i + 1], list(range(e)), _parts(experts), inter, alone[i:i + 1], ids[i:i + 1],
                           scores[i:i + 1], compute="bf16")
    limit = _row_kernel(inter, k_in)
    assert torch.equal(alone, outs[0]) == (rows < limit or limit == 0)


@native
@pytest.mark.parametrize("cap", [60_000, 20_000])
def test_glu_split_by_the_scratch_cap_shares_one_workspace_and_gives_the_same_sums(cap, threads, monkeypatch):
    """A layer whose scratch is past the cap runs as several calls (groups of experts; at the smaller cap an expert
    alone is split into token ranges too) that share one workspace (ms_bf16dot_glu_ws): the same bits as one call."""
    experts, x, ids, scores = _glu_case(12, 64, 128, 96, 90, 4, seed=7)
    threads(2)
    whole = torch.zeros(90, 96)
    fused.moe_glu_bf16(x, list(range(12)), _parts(experts), 64, whole, ids, scores, compute="bf16")
    calls = []
    real = fused._GluCall.__call__

    def spy(self, which, *a):
        calls.append((list(which), self.workspace))
        return real(self, which, *a)

    monkeypatch.setattr(fused._GluCall, "__call__", spy)
    monkeypatch.setattr(fused, "glu_scratch_cap", lambda *a: cap)
    split = torch.zeros(90, 96)
    fused.moe_glu_bf16(x, list(range(12)), _parts(experts), 64, split, ids, scores, compute="bf16")
    assert len(calls) > 2 and all(ws is not None and ws is calls[0][1] for _, ws in calls)
    assert torch.equal(split, whole)


@native
@pytest.mark.parametrize("cap", [4 << 20, 20_000])
def test_glu_given_workspace_serves_every_call(cap, threads, monkeypatch):
    """A workspace passed to moe_glu_bf16 (an engine's, fused.glu_workspace) is what every call of the layer takes,
    one call or several (the scratch cap split), and the sums are those of calls making their own."""
    experts, x, ids, scores = _glu_case(12, 64, 128, 96, 90, 4, seed=7)
    threads(2)
    monkeypatch.setattr(fused, "glu_scratch_cap", lambda *a: cap)
    own = torch.zeros(90, 96)
    fused.moe_glu_bf16(x, list(range(12)), _parts(experts), 64, own, ids, scores, compute="bf16")
    holder = {}
    ws = fused.glu_workspace(holder, 64, 128, 96)
    assert ws.numel() >= fused.glu_scratch_cap(64, 128, 96) and fused.glu_workspace(holder, 64, 128, 96) is ws
    ws.fill_(0xFF)  # junk left by earlier calls changes nothing
    calls = []
    real = fused._GluCall.__call__

    def spy(self, which, *a):
        calls.append(self.workspace)
        return real(self, which, *a)

    monkeypatch.setattr(fused._GluCall, "__call__", spy)
    given = torch.zeros(90, 96)
    fused.moe_glu_bf16(x, list(range(12)), _parts(experts), 64, given, ids, scores, compute="bf16", workspace=ws)
    assert calls and all(w is ws for w in calls) and (len(calls) > 1) == (cap < 1 << 20)
    assert torch.equal(given, own)


@native
def test_glu_workspace_contents_and_size_do_not_change_the_sums():
    """ms_bf16dot_glu_ws over a workspace full of junk, one too small (the call mallocs its own) and none: same bits."""
    experts, x, ids, scores = _glu_case(5, 32, 64, 48, 40, 2, seed=3)
    lib = cpu.required()
    arr = lambda v: (ctypes.c_int64 * len(v))(*v)  # noqa: E731
    outs = []
    need = fused.glu_call_scratch([int((ids == e).sum()) for e in range(5)], 32, 64, bf16=True)
    for ws in (torch.full((need,), 0xFF, dtype=torch.uint8), torch.full((need // 3,), 0x7F, dtype=torch.uint8), None):
        out = torch.zeros(40, 48)
        assert lib.ms_bf16dot_glu_ws(5, arr(range(5)), *(arr([ex[i].data_ptr() for ex in experts]) for i in range(3)),
                                     32, 64, 48, x.data_ptr(), 40, ids.data_ptr(), scores.data_ptr(), 2,
                                     out.data_ptr(), 0, 0.0, 0.0, None if ws is None else ws.data_ptr(),
                                     0 if ws is None else ws.numel()) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])
    assert _rel(outs[2], _glu_reference(experts, x, ids, scores)) < 1e-5


@native
def test_glu_rejects_odd_widths_and_unknown_compute():
    experts, x, ids, scores = _glu_case(2, 5, 8, 8, 4, 1, seed=1)
    with pytest.raises(ValueError, match="even"):
        fused.moe_glu_bf16(x, [0, 1], _parts(experts), 5, torch.zeros(4, 8), ids, scores, compute="bf16")
    with pytest.raises(ValueError, match="compute"):
        fused.moe_glu_bf16(x, [0, 1], _parts(experts), 5, torch.zeros(4, 8), ids, scores, compute="fp16")


@pytest.mark.skipif(shutil.which("gcc") is None or not cpu.available() or cpu.simd() != "avx512",
                    reason="needs gcc and an AVX-512 build to compare against")
def test_portable_build_computes_the_same_products(tmp_path):
    """The library built without AVX-512 BF16 (what a CPU lacking it compiles: pairs widened, two fp32 FMAs) gives
    the same bf16-rounded products up to fp32 summation."""
    lib_path = tmp_path / "portable.so"
    done = subprocess.run(["gcc", *cpu.FLAGS, "-mno-avx512bf16", "-o", str(lib_path), str(cpu._SOURCE), "-lm"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lib = ctypes.CDLL(str(lib_path))
    assert lib.ms_bf16dp() == 0
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ms_bf16dot_linear.argtypes = [p, i64, i64, i64, p, p, p]
    g = seeded(5)
    x, w = torch.randn(37, 96, generator=g), torch.randn(50, 96, generator=g).bfloat16()
    out = torch.empty(37, 50)
    arr = lambda *v: (ctypes.c_int64 * len(v))(*v)  # noqa: E731
    assert lib.ms_bf16dot_linear(x.data_ptr(), 37, 96, 1, arr(w.data_ptr()), arr(50), arr(out.data_ptr())) == 0
    assert _rel(out, _rounded_reference(x, w)) < 1e-5
    assert _rel(out, cpu.linear_bf16dot_many(x, [w])[0]) < 1e-5
    # MXFP4 under bf16 compute: x rounded into a copy, then the fp32 kernel (the same inputs as vdpbf16ps's)
    lib.ms_linear_mxfp4_bf16.argtypes = [i64, p, p, p, p, p, i64, i64, ctypes.c_int, i64, ctypes.c_int]
    packed = torch.randint(0, 256, (50, 80), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 130, (50, 5), dtype=torch.uint8, generator=g)
    x = torch.randn(5, 160, generator=g)
    for t in (1, 5):  # the same x for two entries (rounded once), 1 and 5 tokens
        outs = [torch.empty(t, 50), torch.empty(t, 50)]
        assert lib.ms_linear_mxfp4_bf16(2, arr(x.data_ptr(), x.data_ptr()), arr(t, t),
                                        arr(packed.data_ptr(), packed.data_ptr()),
                                        arr(scales.data_ptr(), scales.data_ptr()),
                                        arr(*(o.data_ptr() for o in outs)), 50, 160, 0, 1, 1) == 0
        want = _rounded_reference(x[:t], quant.dequant_mxfp4(packed, scales))
        assert _rel(outs[0], want) < 1e-5 and torch.equal(outs[0], outs[1])
        assert _rel(outs[0], cpu.linear_mxfp4(x[:t], packed, scales, bf16=True)) < 1e-5


def _glu_call(lib, experts, x, ids, scores, out, act: int, beta: float = 0.0, linear_beta: float = 0.0) -> None:
    arr = lambda v: (ctypes.c_int64 * len(v))(*v)  # noqa: E731
    e, (inter, k_in), d_out = len(experts), experts[0][0].shape, experts[0][2].shape[0]
    assert lib.ms_bf16dot_glu(e, arr(range(e)), *(arr([ex[i].data_ptr() for ex in experts]) for i in range(3)), inter,
                              k_in, d_out, x.data_ptr(), x.shape[0], ids.data_ptr(), scores.data_ptr(), ids.shape[1],
                              out.data_ptr(), act, beta, linear_beta) == 0


def _exp_inputs() -> torch.Tensor:
    """a sweep of [-110, 95], random bit patterns of every exponent (both signs), the edges of the range, inf, NaN"""
    g = seeded(11)
    bits = torch.randint(-(1 << 31), 1 << 31, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([0.0, -0.0, 88.72283, 88.72284, 89.0, 1e30, -87.33654, -103.27893, -103.97, -104.0, -1e30,
                          math.inf, -math.inf, math.nan, 1e-30, -1e-45, 0.34657359, -0.34657359])
    return torch.cat([torch.linspace(-110.0, 95.0, 300_001), bits.view(torch.float32), edges, -edges])


def _glu_exp(lib, x: torch.Tensor) -> torch.Tensor:
    lib.ms_glu_exp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ms_glu_exp.restype = None
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.ms_glu_exp(x.data_ptr(), y.data_ptr(), x.numel())
    return y


@native
def test_the_bf16_paths_exp_is_within_one_ulp():
    """the SiLU of the bf16 path uses its own exp (not the C library's): within 1 ulp of exp in double over normal
    results (measured 0.94 over every float), 0 below the range (or a subnormal within 1 ulp of 2^-149), inf above,
    NaN for NaN"""
    x = _exp_inputs()
    y = _glu_exp(cpu.lib(), x).double()
    want = torch.exp(x.double())
    nan = x.isnan()
    assert y[nan].isnan().all() and not y[~nan].isnan().any()
    x, y, want = x[~nan], y[~nan], want[~nan]
    big = want > 3.4028235677973366e38  # rounds to inf in float
    assert y[big].isinf().all() and not y[~big].isinf().any()
    y, want = y[~big], want[~big]
    ulp = torch.ldexp(torch.ones_like(want), (torch.frexp(want).exponent - 24).clamp(min=-149))
    err = (y - want).abs() / ulp
    assert err.max() <= 1.0, float(err.max())
    assert (y >= 0).all() and (y[want < 2.0 ** -150] == 0).all()


@pytest.mark.skipif(shutil.which("gcc") is None or not cpu.available() or cpu.simd() != "avx512",
                    reason="needs gcc and an AVX-512 build to compare against")
def test_vectorised_glu_parts_are_bit_identical_to_the_scalar_code(tmp_path, threads):
    """AVX-512 packs x, applies the GLU activation (SiLU: the path's own exp, 16 lanes), rounds h to bf16 and
    scatters the weighted outputs in vector code; built with -DMS_GLU_VEC=0 the same library does those in the
    scalar code. Both must give the same bits, for SiLU and SiTU, over shapes with partial panels, column tails, pair
    tails and gates far beyond the exp range; and the exp alone over finite, huge, subnormal-result and NaN inputs."""
    lib_path = tmp_path / "scalar_glu.so"
    done = subprocess.run(["gcc", *cpu.FLAGS, "-DMS_GLU_VEC=0", "-o", str(lib_path), str(cpu._SOURCE), "-lm"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    scalar, vector = ctypes.CDLL(str(lib_path)), cpu.lib()
    cpu._declare(scalar)
    xs = _exp_inputs()
    assert torch.equal(_glu_exp(scalar, xs).view(torch.int32), _glu_exp(vector, xs).view(torch.int32))
    for n in (1, 2):
        scalar.ms_set_threads(n)
        threads(n)
        for e, inter, k_in, d_out, t, k, scale in [(3, 96, 100, 212, 150, 2, 1.0), (2, 36, 300, 200, 37, 1, 30.0),
                                                   (4, 128, 64, 40, 70, 4, 8.0), (1, 6, 34, 17, 3, 1, 200.0)]:
            experts, x, ids, scores = _glu_case(e, inter, k_in, d_out, t, k, seed=t + n)
            x = x * scale
            for act, beta, linear_beta in [(0, 0.0, 0.0), (1, 4.0, 25.0)]:
                want, got = torch.zeros(t, d_out), torch.zeros(t, d_out)
                _glu_call(scalar, experts, x, ids, scores, want, act, beta, linear_beta)
                _glu_call(vector, experts, x, ids, scores, got, act, beta, linear_beta)
                assert want.isfinite().all()
                assert torch.equal(want.view(torch.int32), got.view(torch.int32)), (n, e, inter, k_in, act)
    x = torch.randn(45, 300, generator=seeded(3))
    w = torch.randn(70, 300, generator=seeded(4)).bfloat16()
    want, got = torch.empty(45, 70), torch.empty(45, 70)
    arr = lambda *v: (ctypes.c_int64 * len(v))(*v)  # noqa: E731
    for lib, out in ((scalar, want), (vector, got)):
        assert lib.ms_bf16dot_linear(x.data_ptr(), 45, 300, 1, arr(w.data_ptr()), arr(70), arr(out.data_ptr())) == 0
    assert torch.equal(want, got)


@native
def test_linear_takes_the_bf16_path_only_when_asked_and_many_rows():
    g = seeded(7)
    w = torch.randn(48, 64, generator=g).bfloat16()
    many, few = torch.randn(blocks.BF16_MIN_ROWS, 64, generator=g), torch.randn(blocks.BF16_MIN_ROWS - 1, 64,
                                                                               generator=g)
    fp32, few_fp32 = blocks.linear(many, w), blocks.linear(few, w)
    with blocks.compute_dtype("bf16"):
        assert torch.equal(blocks.linear(many, w), cpu.linear_bf16dot_many(many, [w])[0])
        assert torch.equal(blocks.linear(few, w), few_fp32)  # below the threshold: the fp32 kernels
        assert torch.equal(blocks.linear(many, w, fp32=True), fp32)  # the routers' products
        assert all(torch.equal(a, b) for a, b in zip(blocks.linear_many(many, (w, w)), [blocks.linear(many, w)] * 2))
    assert torch.equal(blocks.linear(many, w), fp32)  # the setting ends with the block
    with pytest.raises(MoestreamError, match="--compute-dtype"):
        with blocks.compute_dtype("fp16"):
            pass


@native
def test_bf16_rows_are_charged_beyond_the_scratch_allowance():
    memory = MemoryAccountant(1 << 30)
    charged = []
    grow = memory.grow_state
    memory.grow_state = lambda n, what="": (charged.append((n, what)), grow(n, what))[1]
    x, w = torch.randn(64, 256), torch.randn(32, 256).bfloat16()
    with blocks.compute_dtype("bf16", memory):
        blocks.linear(x, w)
    assert charged and charged[0][0] == cpu.bf16dot_scratch(64, 256) and "bf16" in charged[0][1]
    assert memory.state_bytes == 0  # released after the call


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16_compute")
    synthesize("qwen3_moe", root / "q", "tiny", cache_dir=root / "cache", progress=False)
    return root / "q"


@native
@pytest.mark.skipif(cpu._USE_COUNT is None, reason="this torch has no storage use count: nothing is kept")
def test_step_buffers_serve_a_later_call_once_the_earlier_output_is_dropped():
    """Within `step_buffers` a product's output (and its input panels) is handed out again to a later call of the
    same shapes once nothing references the earlier one, never while a reference or a view of it lives; the values
    are those of a fresh call; everything kept goes when the block ends."""
    g = seeded(11)
    x, w = torch.randn(300, 128, generator=g), torch.randn(64, 128, generator=g).bfloat16()
    w2 = torch.randn(48, 128, generator=g).bfloat16()
    fresh = cpu.linear_bf16dot_many(x, [w, w2])
    with cpu.step_buffers() as kept:
        a, a2 = cpu.linear_bf16dot_many(x, [w, w2])
        where = a.data_ptr()
        assert kept.nbytes() >= 300 * (64 + 48) * 4 + cpu.lib().ms_bf16dot_linear_scratch(300, 128)
        held = a[5:]  # a view keeps the buffer busy
        del a, a2
        b, _ = cpu.linear_bf16dot_many(x, [w, w2])
        assert b.data_ptr() != where and torch.equal(held, fresh[0][5:])
        del held
        c, c2 = cpu.linear_bf16dot_many(x * 0.5, [w, w2])  # other values into the same memory
        assert c.data_ptr() == where
        assert torch.equal(c, cpu.linear_bf16dot_many(x * 0.5, [w])[0]) and torch.equal(b, fresh[0])
        before = kept.nbytes()
        del c, c2
        d, d2 = cpu.linear_bf16dot_many(x, [w, w2])
        assert d.data_ptr() == where and kept.nbytes() == before  # nothing new once the set is there
        assert torch.equal(d, fresh[0]) and torch.equal(d2, fresh[1])
        with cpu.step_buffers() as inner:  # a nested block serves from the enclosing one
            assert inner is kept
    assert torch.equal(d, fresh[0])  # a tensor handed out stays valid after its block
    with cpu.step_buffers(on=False) as none:
        assert none is None and cpu.step_buffer((4, 4)).shape == (4, 4)  # outside a block: fresh tensors


@native
def test_engine_steps_keep_their_products_buffers_with_the_same_logits(tiny, monkeypatch):
    """A bf16 prompt step of STEP_BUFFER_ROWS+ rows under a scheduler's watch (the fixed mmap threshold) keeps its
    dense products' buffers for its later layers (each layer after the first asks for shapes the step already
    holds): its logits are bit for bit those of the same step with nothing kept."""
    from moestream.engine import engine as engine_mod
    ids = prompt_ids(512, 300, seed=9)
    eng = Engine.open(tiny, 1 << 30, compute_dtype="bf16", prefill_chunk=512)
    eng.watch_resident()
    takes, made = [], []
    real = cpu.StepBuffers.take

    def take(self, shape, dtype):
        before = self.nbytes()
        got = real(self, shape, dtype)
        takes.append(shape)
        made.append(self.nbytes() > before)
        return got

    monkeypatch.setattr(cpu.StepBuffers, "take", take)
    kept = eng.logits(ids)
    layers = len(eng.model.layers)
    assert layers >= 2 and len(takes) >= 4 * layers  # q/k/v, o and two panels a layer at least
    assert sum(made) <= 8 and not any(made[len(made) // layers * 2:-2])  # later layers reuse the first ones'
    monkeypatch.setattr(engine_mod, "STEP_BUFFER_ROWS", 10 ** 9)
    takes.clear()
    assert torch.equal(eng.logits(ids), kept) and not takes


@native
def test_engine_bf16_within_bound_and_same_greedy_tokens(tiny, monkeypatch):
    """A 96-token prompt (dense products and routed experts all in bf16) against the fp32 engine. The bound: bf16
    keeps 8 significant bits (each rounding up to 2^-9 relative), a few such roundings per layer accumulate, so
    a row's logits move by a few 1e-3 of their largest value (measured: median 0.0045 on this model); a token whose
    hidden state moves across a router's decision boundary takes another expert and moves more, so the bound is
    on the median and the 90th percentile of the rows, not their maximum. Greedy continuations agree."""
    ids = prompt_ids(512, 96, seed=4)
    f32 = Engine.open(tiny)
    b16 = Engine.open(tiny, compute_dtype="bf16")
    computes, glu = [], fused.moe_glu_bf16
    monkeypatch.setattr(fused, "moe_glu_bf16", lambda *a, **kw: (computes.append(kw.get("compute")), glu(*a, **kw)))
    a = f32.logits(ids)
    assert set(computes) == {"fp32"}
    computes.clear()
    b = b16.logits(ids)
    assert set(computes) == {"bf16"}  # the routed experts of a 96-row step too, not only the dense products
    computes.clear()
    rows = (b - a).abs().amax(-1) / a.abs().amax(-1)
    assert not torch.equal(a, b)  # the option does something
    assert float(rows.median()) < 0.01 and float(rows.quantile(0.9)) < 0.03
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95
    assert b16.generate(ids, 8) == f32.generate(ids, 8)
    # the bf16 engine's GLU calls took their scratch from one workspace it keeps (blocks._SCRATCH), not fresh memory
    kept = blocks._SCRATCH[b16.memory]["glu"]
    b16.logits(ids)
    assert blocks._SCRATCH[b16.memory]["glu"] is kept and f32.memory not in blocks._SCRATCH
    computes.clear()
    # decode steps (one row) stay on the fp32 kernels: the same logits whatever the option
    sa, sb = f32.new_sequence(), b16.new_sequence()
    try:
        f32.prefill(sa, ids[:8])
        b16.prefill(sb, ids[:8])  # 8 rows: below the threshold, fp32 too
        assert torch.equal(f32.step([(sa, [ids[8]])])[0], b16.step([(sb, [ids[8]])])[0])
        assert "bf16" not in computes
    finally:
        f32.free(sa)
        b16.free(sb)


@native
@pytest.mark.parametrize("family", ["kimi_k3", "gpt_oss"])
def test_mxfp4_experts_decode_in_bf16_within_bound(tmp_path, monkeypatch, family):
    """MXFP4 experts (K3's latent experts, gpt-oss's) under bf16 compute round their activations at every row count
    (blocks.mxfp4_bf16): one-token decode steps too, where other products keep fp32. Their logits move within
    bf16's bound (the module's first test explains it) and greedy tokens agree; under fp32 no MXFP4 call rounds."""
    path = tmp_path / family
    synthesize(family, path, "tiny", progress=False)
    ids = prompt_ids(256, 12, seed=3)
    seen, entry = [], cpu._mxfp4_entry
    monkeypatch.setattr(cpu, "_mxfp4_entry", lambda handle, bf16: (seen.append(bf16), entry(handle, bf16))[1])
    f32, b16 = Engine.open(path), Engine.open(path, compute_dtype="bf16")
    a = decode_logits(f32, ids)
    assert seen and not any(seen)
    seen.clear()
    b = decode_logits(b16, ids)
    assert seen and all(seen)
    rows = (b - a).abs().amax(-1) / a.abs().amax(-1)
    assert not torch.equal(a, b)
    assert float(rows.median()) < 0.01 and float(rows.max()) < 0.03
    assert b16.generate(ids, 8) == f32.generate(ids, 8)


@pytest.mark.parametrize("rows,native_on", [(24, True), (80, True), (8, False), (40, False)])
def test_k3_grouped_mxfp4_experts_round_under_bf16_on_every_path(rows, native_on):
    """K3's grouped MXFP4 experts (latent_moe.mxfp4_group) under bf16 compute on each of its paths (the native call up
    to NATIVE_GROUP_MAX_ROWS rows, the decoded planes beyond it or without the native kernels: all rows through all
    experts up to DENSE_GROUP_MAX_ROWS, an expert's own rows beyond) give bf16(z) and bf16(h) products: against a
    float64 reference of the rounded inputs; under fp32 against the unrounded one."""
    from moestream.kernels import quant as q
    from moestream.models import latent_moe

    g = seeded(rows)
    inter, latent, experts = 64, 96, 4
    tensors = [{f"{w}_packed": torch.randint(0, 256, (o, i // 2), dtype=torch.uint8, generator=g)
                for w, o, i in (("w1", inter, latent), ("w3", inter, latent), ("w2", latent, inter))}
               for _ in range(experts)]
    for t in tensors:
        for w, o, i in (("w1", inter, latent), ("w3", inter, latent), ("w2", latent, inter)):
            t[f"{w}_scale"] = torch.randint(118, 128, (o, i // 32), dtype=torch.uint8, generator=g)
    z = torch.randn(rows, latent, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(rows)])
    weights = torch.rand(rows, 2, generator=g)
    act = latent_moe.make_act(4.0, 25.0)
    w = [{k: q.dequant_mxfp4(t[f"{k}_packed"], t[f"{k}_scale"]).double() for k in ("w1", "w3", "w2")} for t in tensors]

    def reference(rnd):
        out = torch.zeros(rows, latent, dtype=torch.float64)
        for r in range(rows):
            x = rnd(z[r]).double()
            for j in range(2):
                e = int(ids[r, j])
                h = rnd(act((w[e]["w1"] @ x).float(), (w[e]["w3"] @ x).float())).double()
                out[r] += float(weights[r, j]) * (w[e]["w2"] @ h)
        return out

    for mode, rnd in (("bf16", lambda v: v.bfloat16().float()), ("fp32", lambda v: v)):
        out = torch.zeros(rows, latent)
        with blocks.compute_dtype(mode), (contextlib.nullcontext() if native_on else cpu.disabled()):
            assert latent_moe.mxfp4_group(act)(z, ids, weights, list(range(experts)), tensors, out)
        want = reference(rnd)
        assert _rel(out, want) < 1e-4, mode
        if mode == "bf16":
            assert _rel(out, reference(lambda v: v)) > 1e-4  # the rounding is there


def test_option_is_validated(tiny, capsys):
    from moestream.cli import main

    with pytest.raises(MoestreamError, match="--compute-dtype must be one of fp32, bf16"):
        Engine.open(tiny, compute_dtype="fp16")
    for cmd in ("run", "bench", "batch", "serve"):
        with pytest.raises(SystemExit) as exc:  # argparse's choices: exit status 2, naming the valid ones
            main([cmd, str(tiny), "--compute-dtype", "fp16"] + (["in.jsonl", "-o", "out.jsonl"] if cmd == "batch"
                                                               else []))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--compute-dtype" in err and "bf16" in err, (cmd, err)
