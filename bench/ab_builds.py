"""A/B of native library builds in one process: the same source compiled with different -D settings, loaded side by
side, their calls alternated round by round so that the shared machine's drift hits every build alike.

    python bench/ab_builds.py glu [--codec b12|b12x|bf16] [--tokens 1] [--experts 256] [--threads 2] [--rounds 8] NAME:FLAGS ...
    python bench/ab_builds.py dense [--codec b12|bf16] [--tokens 16] [--threads 2] [--rounds 8] NAME:FLAGS NAME:FLAGS ...
    python bench/ab_builds.py fp8|int4|mxfp4|mxfp4_bf16 [--tokens 1] [--threads 2] [--rounds 8] NAME:FLAGS ...

e.g. `python bench/ab_builds.py glu old:"-DGLU_ROWS_ONE=16 -DDOWN_CHUNK_ONE=64" new:` (an empty FLAGS is the
tree's own settings). The first build is the baseline of the ratios.

glu: one decode token's grouped expert call (ms_moe_glu_bf16: one row, or --tokens rows each routed to all 8;
8 experts of the peer checkpoint's shape, gate/up 512 x 1024, down 1024 x 512, random N(0, 0.02) bf16 values,
b12-coded (b12x: in the smaller form, as `pack` codes them) or not) over a pool of 256 experts (650-800 MB, past
the last-level cache), as a warm decode step streams them; reports bytes of stored weights a second. dense: 16-token (--tokens) products (bf16 or b12-coded weights) at the peer's
attention shapes (q/k/v 1536 x 1024 in one weight, o 1024 x 1024) over 32 layers of weights (168 MB), through
ms_linear_bf16; reports GFLOP/s. Both report, per
build, the median and range over the rounds, the median of the per-round ratios to the first build, and whether
its outputs equal the first build's bit for bit. Each build's pool of native threads sleeps 10 ms before and after
its turn, so that one build's spinning workers do not take the CPU from the next.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import moestream  # noqa: F401  # before torch: its OpenMP runtime's wait policy (moestream/omp.py)
import torch

from moestream.kernels import b12, cpu


def build(name: str, flags: str, where: Path, threads: int) -> ctypes.CDLL:
    out = where / f"ab_{name}.so"
    done = subprocess.run(["gcc", *cpu.FLAGS, *flags.split(), "-o", str(out), str(cpu._SOURCE), "-lm"],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"build {name!r} ({flags}) failed:\n{done.stderr}")
    lib = ctypes.CDLL(str(out))
    cpu._declare(lib)
    lib.ms_set_threads(threads)
    return lib


def glu_case(codec: str, rows: int = 1, experts: int = 256, per_call: int = 8):
    """(work(lib, out), out shape, bytes a pass): every group of `per_call` pool experts once, `rows` tokens each
    routed to every expert of the group."""
    inter, hidden = 512, 1024
    g = torch.Generator().manual_seed(0)
    distinct = []
    for _ in range(per_call):
        mats = [(torch.randn(r, c, generator=g) * 0.02).bfloat16()
                for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]
        distinct.append([(b12.encode_smaller(m) if codec == "b12x" else b12.encode(m))
                         if codec != "bf16" else m.contiguous().view(torch.uint8).reshape(-1)
                         for m in mats])
    tag = 1 if codec != "bf16" else 0
    pool = [[t.clone() for t in distinct[e % per_call]] for e in range(experts)]
    A = ctypes.c_int64 * per_call
    groups = [tuple(A(*[pool[s + j][m].data_ptr() | tag for j in range(per_call)]) for m in range(3))
              for s in range(0, experts, per_call)]
    ex = A(*range(per_call))
    ids = (ctypes.c_int64 * (rows * per_call))(*(list(range(per_call)) * rows))
    wts = (ctypes.c_float * (rows * per_call))(*([1.0 / per_call] * (rows * per_call)))
    x = torch.randn(rows, hidden, generator=g)

    def work(lib: ctypes.CDLL, out: torch.Tensor) -> None:
        for gates, ups, downs in groups:
            out.zero_()
            lib.ms_moe_glu_bf16(per_call, ex, gates, ups, downs, inter, hidden, hidden, x.data_ptr(), rows, ids,
                                wts, per_call, out.data_ptr(), 0, 0.0, 0.0)

    nbytes = sum(t.numel() for e in pool for t in e)
    return work, (rows, hidden), nbytes, pool


def dense_case(tokens: int, codec: str = "bf16", layers: int = 32):
    """(work(lib, out), out shape, FLOPs a pass): the attention projections of `layers` layers at `tokens` rows,
    bf16 or b12-coded (a tagged address, as a coded pack's dense weights go to the kernel)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(1536, 1024), (1024, 1024)]
    ws = [[(torch.randn(n, k, generator=g) * 0.02).bfloat16() for n, k in shapes] for _ in range(layers)]
    if codec != "bf16":
        code = b12.encode_smaller if codec == "b12x" else b12.encode
        ws = [[(code(w), w.shape[0]) for w in layer] for layer in ws]
        tag = 1
    else:
        ws = [[(w, w.shape[0]) for w in layer] for layer in ws]
        tag = 0
    x = torch.randn(tokens, 1024, generator=g)

    def work(lib: ctypes.CDLL, out: torch.Tensor) -> None:
        for layer in ws:
            for w, n in layer:
                lib.ms_linear_bf16(x.data_ptr(), tokens, 1024, w.data_ptr() | tag, n, out.data_ptr(), 16)

    return work, (tokens, 1536), 2 * tokens * layers * sum(n * k for n, k in shapes), ws


def quant_case(kind: str, tokens: int):
    """(work(lib, out), out shape, bytes a pass): `tokens` rows through DeepSeek-V3 / Kimi K2 expert-shaped weights
    (2048 x 7168 and 7168 x 2048) past the last-level cache, as a decode step streams them: `fp8` block-FP8 (128 x
    128 tiles, 12 copies of each: 350 MB) by ms_linear_fp8, `int4` pack-quantized (groups of 32, bf16 scales, 24
    copies: 370 MB) by ms_linear_int4."""
    from moestream.kernels import quant

    g = torch.Generator().manual_seed(0)
    ws = []
    for n, k in ((2048, 7168), (7168, 2048)):
        dense = torch.randn(n, k, generator=g) * 0.02
        codes, scale = quant.quantize_fp8_block(dense) if kind == "fp8" else quant.pack_int4(dense)
        ws += [(codes.clone(), scale.clone(), n, k) for _ in range(12 if kind == "fp8" else 24)]
    xs = {k: torch.randn(tokens, k, generator=g) for k in (7168, 2048)}

    def work(lib: ctypes.CDLL, out: torch.Tensor) -> None:
        for codes, scale, n, k in ws:
            if kind == "fp8":
                lib.ms_linear_fp8(xs[k].data_ptr(), tokens, k, codes.data_ptr(), n, scale.data_ptr(), 128, 128,
                                  out.data_ptr(), 16)
            else:
                lib.ms_linear_int4(xs[k].data_ptr(), tokens, k, codes.data_ptr(), scale.data_ptr(), 1, n,
                                   out.data_ptr(), 16)

    return work, (tokens, 7168), sum(c.numel() * c.element_size() + s.numel() * s.element_size()
                                     for c, s, _, _ in ws), ws


def mxfp4_case(tokens: int, bf16: bool, experts: int = 16):
    """(work(lib, out), out shape, bytes a pass): `tokens` rows through `experts` Kimi K3 MXFP4 experts (w1 / w3 3072
    x 3584, w2 3584 x 3072: 281 MB) in two grouped calls, as the latent MoE's native group makes them:
    ms_linear_mxfp4, or with `bf16` ms_linear_mxfp4_bf16 (x rounded to bf16)."""
    g = torch.Generator().manual_seed(0)
    inter, latent = 3072, 3584
    mats = []
    for _ in range(experts):
        for n, k in ((inter, latent), (inter, latent), (latent, inter)):
            mats.append((torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                         torch.randint(118, 128, (n, k // 32), dtype=torch.uint8, generator=g)))
    A = ctypes.c_int64
    x13, x2 = torch.randn(tokens, latent, generator=g), torch.randn(tokens, inter, generator=g)
    y13 = torch.empty(2 * experts, tokens, inter)

    def arrays(sel, xs, outs):
        n = len(sel)
        return ((A * n)(*xs), (A * n)(*([tokens] * n)), (A * n)(*[mats[i][0].data_ptr() for i in sel]),
                (A * n)(*[mats[i][1].data_ptr() for i in sel]), (A * n)(*outs))

    first = [i for i in range(3 * experts) if i % 3 != 2]
    calls13 = arrays(first, [x13.data_ptr()] * len(first), [y13[j].data_ptr() for j in range(len(first))])

    def work(lib: ctypes.CDLL, out: torch.Tensor) -> None:
        fn = lib.ms_linear_mxfp4_bf16 if bf16 else lib.ms_linear_mxfp4
        fn(len(first), *calls13, inter, latent, 0, 16, 0)
        down = arrays([i for i in range(3 * experts) if i % 3 == 2], [x2.data_ptr()] * experts,
                      [out[e].data_ptr() for e in range(experts)])
        fn(experts, *down, latent, inter, 0, 16, 0)

    # the tensors the calls' addresses point into stay alive with the case (x13 and y13 only by address above)
    return work, (experts, tokens, latent), sum(p.numel() + s.numel() for p, s in mats), (mats, x13, y13)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("glu", "dense", "fp8", "int4", "mxfp4", "mxfp4_bf16"))
    ap.add_argument("builds", nargs="+", help="NAME:FLAGS (FLAGS: -D settings, may be empty)")
    ap.add_argument("--codec", choices=("b12", "b12x", "bf16"), default="b12",
                    help="glu: b12x codes each expert matrix in the smaller form, as `moestream pack` does")
    ap.add_argument("--tokens", type=int, default=None,
                    help="rows: dense, the product's (default 16); glu, each expert's (default 1); fp8, the "
                         "product's (default 1); int4, the same")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256,
                    help="glu: the pool's experts (256: past the last-level cache; 8: one call's, in cache)")
    a = ap.parse_args()
    builds = [b.split(":", 1) if ":" in b else (b, "") for b in a.builds]
    a.tokens = a.tokens or (16 if a.kind == "dense" else 1)
    with tempfile.TemporaryDirectory(prefix="ab_builds-") as tmp:
        libs = {name: build(name, flags, Path(tmp), a.threads) for name, flags in builds}
        if a.kind == "glu":
            work, shape, amount, _keep = glu_case(a.codec, a.tokens, a.experts)
            unit, what = 1e9, f"GB/s of {a.codec} weights, {a.tokens} rows an expert"
        elif a.kind.startswith("mxfp4"):
            work, shape, amount, _keep = mxfp4_case(a.tokens, a.kind == "mxfp4_bf16")
            unit, what = 1e9, f"GB/s of MXFP4 codes and scales ({a.kind}), {a.tokens} rows"
        elif a.kind in ("fp8", "int4"):
            work, shape, amount, _keep = quant_case(a.kind, a.tokens)
            unit, what = 1e9, f"GB/s of {a.kind} weights and scales, {a.tokens} rows"
        else:
            work, shape, amount, _keep = dense_case(a.tokens, a.codec)
            unit, what = 1e9, f"GFLOP/s at {a.tokens} rows"
        outs = {name: torch.zeros(shape) for name in libs}
        rates: dict[str, list[float]] = {name: [] for name in libs}
        for _ in range(a.rounds):
            for name, lib in libs.items():
                work(lib, outs[name])  # warm (and the sleeping pool of the last build out of the way)
                time.sleep(0.01)
                t0 = time.perf_counter()
                work(lib, outs[name])
                work(lib, outs[name])
                rates[name].append(2 * amount / (time.perf_counter() - t0) / unit)
                time.sleep(0.01)
    base = builds[0][0]
    print(f"{a.kind}, {a.threads} threads, {a.rounds} rounds ({what}):")
    for name, flags in builds:
        r = rates[name]
        ratio = statistics.median(x / y for x, y in zip(r, rates[base]))
        print(f"  {name:<12} [{flags}] median {statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f}), "
              f"{ratio:.3f}x {base}, same bits as {base}: {torch.equal(outs[name], outs[base])}")


if __name__ == "__main__":
    main()
