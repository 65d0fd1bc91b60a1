"""Weight-kernel throughput: memory bandwidth, mxfp4_linear packed bytes/s, and bf16/fp32 GEMV streaming rates.

Usage: python bench/kernels.py --rows 3072 --cols 3584 --tokens 1 8 [--chunks 64 128 256] [--baseline]
       python bench/kernels.py --batched [--batch-rows 16 64 128 512] [--expert 512x1024] [--threads 2]
       (--batched also runs the bf16 compute path, EngineOptions.compute_dtype "bf16", against torch's bf16 GEMM)
       python bench/kernels.py --native [--shapes 768x2048 2048x768 3072x3584] [--tokens 1 8] [--thread-counts 1 2]
                               [--p10] [--formats bf16 mxfp4 glu8]
--native prints the native kernels (moestream.kernels.cpu) and the torch paths side by side, each shape, token
count and thread count measured back to back in one process (torch.set_num_threads and cpu.set_threads alike).
Every weight is cycled through enough copies to exceed the last-level cache, so rates are streaming rates; "of bw"
is the native rate over the memory read bandwidth measured first with the same thread count.
Prints a table and then one JSON line. On a shared machine wall time mostly measures the other tenants:
`--threads 1 --cpu-time` times the calling thread's CPU time instead.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable

import torch

from moestream.kernels import cpu, fused, quant
from moestream.models import blocks


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=3072, help="output features (K3 w1/w3: 3072)")
    parser.add_argument("--cols", type=int, default=3584, help="input features, a multiple of 32 (K3 w1/w3: 3584)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="token counts T to measure")
    parser.add_argument("--chunks", type=int, nargs="*", default=[], help="extra rows_per_chunk values to sweep")
    parser.add_argument("--baseline", action="store_true", help="also time the naive table[packed] kernel")
    parser.add_argument("--probe-mb", type=int, default=512, help="bandwidth probe size in MiB")
    parser.add_argument("--footprint-mb", type=int, default=96, help="MiB cycled per kernel (beats the LLC)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    parser.add_argument("--cpu-time", action="store_true", help="time thread CPU time, not wall (use --threads 1)")
    parser.add_argument("--seconds", type=float, default=0.3, help="minimum time per measurement")
    parser.add_argument("--native", action="store_true", help="native vs torch table instead (see --shapes)")
    parser.add_argument("--shapes", nargs="+", default=["768x2048", "2048x768", "128x128", "3072x3584"],
                        help="ROWSxCOLS weights for --native (demo model experts: 128x128)")
    parser.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2], help="threads for --native")
    parser.add_argument("--formats", nargs="+", default=["bf16", "mxfp4"],
                        help="weight formats for --native: bf16, mxfp4, glu8 (8 grouped bf16 GLU experts INTERxHIDDEN)")
    parser.add_argument("--p10", action="store_true",
                        help="--native: 10th percentile of single-call wall times (free cores) instead of best mean")
    parser.add_argument("--batched", action="store_true",
                        help="batched expert matmul (--batch-rows rows through one --expert) vs the fp32 GEMM rate")
    parser.add_argument("--batch-rows", type=int, nargs="+", default=[16, 64, 128, 512])
    parser.add_argument("--expert", default="512x1024", help="INTERxHIDDEN of the --batched expert (peer: 512x1024)")
    return parser.parse_args()


def copies_for(nbytes: int, footprint: int) -> int:
    return max(1, math.ceil(footprint / nbytes))


def clones(t: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Distinct copies (separate memory) so that cycling through them streams from DRAM."""
    return [t] + [t.clone() for _ in range(count - 1)]


def rate(fn: Callable[[int], object], copies: int, seconds: float,
         clock: Callable[[], float] = time.perf_counter) -> float:
    """Calls per second: best of 3 rounds, each cycling through the copies for at least `seconds` / 3."""
    fn(0)
    best = math.inf
    for _ in range(3):
        calls, begin = 0, clock()
        while calls < min(copies, 8) or clock() - begin < seconds / 3:
            fn(calls % copies)
            calls += 1
        best = min(best, (clock() - begin) / calls)
    return 1.0 / best


def rate_p10(fn: Callable[[int], object], copies: int, seconds: float) -> float:
    """Calls per second from the 10th percentile of single-call wall times: on a shared machine, the calls that
    found their cores free (what a dedicated machine would see)."""
    fn(0)
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < max(20, min(copies, 8)) or time.perf_counter() - begin < seconds:
        t = time.perf_counter()
        fn(len(times) % copies)
        times.append(time.perf_counter() - t)
    times.sort()
    return 1.0 / times[len(times) // 10]


def lut_baseline(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """The first version: a 256-entry byte -> (even, odd) fp32 pair table, times the scale, then mm per chunk."""
    byte = torch.arange(256)
    pairs = torch.stack((quant.E2M1_VALUES[byte & 15], quant.E2M1_VALUES[byte >> 4]), dim=1)
    mult = quant.e8m0_to_float(scales)
    out = torch.empty(x.shape[0], packed.shape[0])
    for r in range(0, packed.shape[0], rows):
        n = min(rows, packed.shape[0] - r)
        w = pairs[packed[r:r + n].long()].view(n, -1, 32) * mult[r:r + n].unsqueeze(-1)
        torch.mm(x, w.view(n, -1).T, out=out[:, r:r + n])
    return out


def native_table(args: argparse.Namespace) -> None:
    """Native vs torch, GB/s of stored weight bytes, for each shape x format x T x threads."""
    if not cpu.available():
        raise SystemExit(cpu.reason())
    clock = time.thread_time if args.cpu_time else time.perf_counter
    footprint = args.footprint_mb << 20
    g = torch.Generator().manual_seed(0)
    results = []
    clock_name = "p10 of single calls" if args.p10 else ("thread CPU" if args.cpu_time else "wall")
    print(f"native kernels: simd {cpu.simd()}   clock {clock_name}   "
          f"(GB/s of stored weight bytes; each pair measured back to back)")
    bandwidth = {}
    for threads in args.thread_counts:  # the read rate the weight streams compare against, same thread count
        torch.set_num_threads(threads)
        bandwidth[threads] = quant.bandwidth_probe(args.probe_mb << 20)
        print(f"memory read bandwidth, {threads} thread(s): {bandwidth[threads] / 1e9:.2f} GB/s (torch.sum)")
    print(f"{'format':<7}{'shape':>11}{'T':>4}{'thr':>4}{'native ms':>11}{'GB/s':>7}{'of bw':>7}{'torch ms':>10}"
          f"{'GB/s':>7}{'speedup':>9}", flush=True)
    for shape in args.shapes:
        rows, cols = (int(v) for v in shape.split("x"))
        for fmt in args.formats:
            if fmt == "glu8":  # a decode step's 8 routed experts (gate, up [rows, cols], down [cols, rows]), one call
                nbytes = 8 * 3 * rows * cols * 2
                n = copies_for(nbytes, footprint)
                sets = [[tuple(torch.randn(*s, generator=g).bfloat16() for s in ((rows, cols), (rows, cols),
                                                                                   (cols, rows))) for _ in range(8)]
                        for _ in range(n)]
                ptrs = [[tuple(m.data_ptr() for m in e) for e in es] for es in sets]
                ids, wts = torch.arange(8).view(1, 8), torch.full((1, 8), 0.125)
                native = lambda x, i: fused.moe_glu_bf16(x, list(range(8)), ptrs[i], rows,  # noqa: E731
                                                         torch.zeros(x.shape[0], cols), ids, wts)

                def torch_path(x, i):
                    with cpu.disabled():
                        return sum(blocks.glu_mlp(x, *e) for e in sets[i])
            elif fmt == "bf16":
                nbytes = rows * cols * 2
                n = copies_for(nbytes, footprint)
                ws = clones(torch.randn(rows, cols, generator=g).bfloat16(), n)
                native = lambda x, i: cpu.linear_bf16(x, ws[i])  # noqa: E731

                def torch_path(x, i):
                    with cpu.disabled():
                        return blocks.linear(x, ws[i])
            else:
                nbytes = rows * cols // 2 + rows * cols // 32
                n = copies_for(nbytes, footprint)
                ps = clones(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g), n)
                ss = clones(torch.randint(118, 128, (rows, cols // 32), dtype=torch.uint8, generator=g), n)
                native = lambda x, i: quant.mxfp4_linear(x, ps[i], ss[i])  # noqa: E731

                def torch_path(x, i):
                    with cpu.disabled():
                        return quant.mxfp4_linear(x, ps[i], ss[i])
            for tokens in args.tokens:
                x = torch.randn(tokens, cols, generator=g)
                for threads in args.thread_counts:
                    torch.set_num_threads(threads)
                    cpu.set_threads(threads)
                    if args.p10:
                        a = rate_p10(lambda i: native(x, i), n, args.seconds)
                        b = rate_p10(lambda i: torch_path(x, i), n, args.seconds)
                    else:
                        a = rate(lambda i: native(x, i), n, args.seconds, clock)
                        b = rate(lambda i: torch_path(x, i), n, args.seconds, clock)
                    r = {"format": fmt, "rows": rows, "cols": cols, "tokens": tokens, "threads": threads,
                         "native_ms": 1e3 / a, "native_GBps": nbytes * a / 1e9, "torch_ms": 1e3 / b,
                         "torch_GBps": nbytes * b / 1e9, "of_bandwidth": nbytes * a / bandwidth[threads]}
                    results.append(r)
                    print(f"{fmt:<7}{shape:>11}{tokens:>4}{threads:>4}{r['native_ms']:>11.3f}{r['native_GBps']:>7.2f}"
                          f"{r['of_bandwidth']:>7.0%}{r['torch_ms']:>10.3f}{r['torch_GBps']:>7.2f}{a / b:>8.2f}x",
                          flush=True)
    print(json.dumps({"native": results, "bandwidth_Bps": bandwidth}))


def batched_table(args: argparse.Namespace) -> None:
    """One expert (gate, up: [I, H], down: [H, I], bf16) over R rows, as a prefill step runs it (each bf16 part
    upcast to fp32, then torch's fp32 GEMM; blocks.linear) and through the native grouped kernel, in GFLOP/s
    against torch's fp32 GEMM rate on a square matrix (the machine's measured matmul rate, same threads); and the
    native grouped kernel's bf16 compute path (bf16-rounded rows, fp32 sums: _cpu_bf16.c) against torch's bf16
    GEMM rate on the same square matrix."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    clock = time.thread_time if args.cpu_time else time.perf_counter  # --cpu-time: the calling thread's CPU time
    cpu.set_threads(torch.get_num_threads())
    g = torch.Generator().manual_seed(0)
    inter, hidden = (int(v) for v in args.expert.split("x"))
    a, b = torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    peak = 2 * 1024 ** 3 * rate(lambda i: torch.mm(a, b), 1, args.seconds, clock) / 1e9
    ab, bb = a.bfloat16(), b.bfloat16()
    peak16 = 2 * 1024 ** 3 * rate(lambda i: torch.mm(ab, bb), 1, args.seconds, clock) / 1e9
    print(f"{'rows':>6}{'upcast+GEMM GFLOP/s':>22}{'of GEMM':>9}{'native GFLOP/s':>16}{'of GEMM':>9}"
          f"{'bf16 GFLOP/s':>14}{'of bf16 GEMM':>14}", flush=True)
    parts = [torch.randn(*s, generator=g).bfloat16() for s in ((inter, hidden), (inter, hidden), (hidden, inter))]
    # copies of the expert cycled through --footprint-mb, so its weights come from DRAM as in a real step
    n = copies_for(3 * inter * hidden * 2, args.footprint_mb << 20)
    copies = [parts] + [[p.clone() for p in parts] for _ in range(n - 1)]
    ptrs = [[tuple(p.data_ptr() for p in c)] for c in copies]
    print(f"fp32 GEMM 1024^3: {peak:.1f} GFLOP/s   bf16 GEMM 1024^3: {peak16:.1f} GFLOP/s   threads "
          f"{torch.get_num_threads()}   clock {'thread CPU' if args.cpu_time else 'wall'}   expert {inter}x{hidden}"
          f"   native: {n} copies cycled   AVX-512 BF16: {cpu.bf16dot()}")
    results = []
    for rows in args.batch_rows:
        x = torch.randn(rows, hidden, generator=g)
        flops = 2 * rows * 3 * inter * hidden
        with cpu.disabled():
            torch_rate = flops * rate(lambda i: blocks.glu_mlp(x, *parts), 1, args.seconds, clock) / 1e9
        out = torch.zeros(rows, hidden)
        native_rate = flops * rate(lambda i: fused.moe_glu_bf16(x, [0], ptrs[i], inter, out), n, args.seconds,
                                   clock) / 1e9
        bf16_rate = flops * rate(lambda i: fused.moe_glu_bf16(x, [0], ptrs[i], inter, out, compute="bf16"), n,
                                 args.seconds, clock) / 1e9
        results.append({"rows": rows, "torch_GFLOPs": torch_rate, "native_GFLOPs": native_rate, "gemm_GFLOPs": peak,
                        "bf16_GFLOPs": bf16_rate, "gemm_bf16_GFLOPs": peak16})
        print(f"{rows:>6}{torch_rate:>22.1f}{torch_rate / peak:>9.0%}{native_rate:>16.1f}{native_rate / peak:>9.0%}"
              f"{bf16_rate:>14.1f}{bf16_rate / peak16:>14.0%}", flush=True)
    # a dense projection ([hidden, hidden] bf16, cycled like the expert) through blocks.linear in each precision,
    # and torch's own bf16 linear (bf16 out) for the choice of kernel
    w = [torch.randn(hidden, hidden, generator=g).bfloat16() for _ in range(copies_for(2 * hidden * hidden,
                                                                                      args.footprint_mb << 20))]
    print(f"{'rows':>6}{'dense fp32 GFLOP/s':>20}{'dense bf16 GFLOP/s':>20}{'torch bf16 GFLOP/s':>20}", flush=True)
    dense = []
    for rows in args.batch_rows:
        x = torch.randn(rows, hidden, generator=g)
        flops = 2 * rows * hidden * hidden
        f32 = flops * rate(lambda i: blocks.linear(x, w[i]), len(w), args.seconds, clock) / 1e9
        with blocks.compute_dtype("bf16"):
            b16 = flops * rate(lambda i: blocks.linear(x, w[i]), len(w), args.seconds, clock) / 1e9
        tb16 = flops * rate(lambda i: torch.nn.functional.linear(x.bfloat16(), w[i]).float(), len(w),
                            args.seconds, clock) / 1e9
        dense.append({"rows": rows, "fp32_GFLOPs": f32, "bf16_GFLOPs": b16, "torch_bf16_GFLOPs": tb16})
        print(f"{rows:>6}{f32:>20.1f}{b16:>20.1f}{tb16:>20.1f}", flush=True)
    print(json.dumps({"batched": results, "dense": dense, "gemm_GFLOPs": peak, "gemm_bf16_GFLOPs": peak16,
                      "avx512_bf16": cpu.bf16dot()}))


def main() -> None:
    args = parse_args()
    if args.batched:
        batched_table(args)
        return
    if args.native:
        native_table(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    rows, cols = args.rows, args.cols
    footprint = args.footprint_mb << 20
    results: list[dict] = []

    bandwidth = quant.bandwidth_probe(args.probe_mb << 20)

    g = torch.Generator().manual_seed(0)
    n_mx = copies_for(rows * cols // 2 + rows * cols // 32, footprint)
    packed = clones(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g), n_mx)
    scales = clones(torch.randint(118, 128, (rows, cols // 32), dtype=torch.uint8, generator=g), n_mx)
    mx_bytes = packed[0].numel() + scales[0].numel()

    print(f"memory read bandwidth: {bandwidth / 1e9:.2f} GB/s   weight {rows} x {cols}   "
          f"threads {torch.get_num_threads()}   clock {'thread CPU' if args.cpu_time else 'wall'}")
    print(f"{'kernel':<22}{'T':>4}{'chunk':>7}{'MB':>9}{'ms':>9}{'GB/s':>8}{'of bw':>8}", flush=True)

    def record(kernel: str, tokens: int, nbytes: int, calls_per_s: float, **extra: object) -> None:
        r = {"kernel": kernel, "tokens": tokens, "weight_bytes": nbytes, "ms": 1e3 / calls_per_s,
             "GBps": nbytes * calls_per_s / 1e9, "of_bandwidth": nbytes * calls_per_s / bandwidth, **extra}
        results.append(r)
        print(f"{kernel:<22}{tokens:>4}{str(r.get('rows_per_chunk', '')):>7}{nbytes / 1e6:>9.2f}"
              f"{r['ms']:>9.2f}{r['GBps']:>8.2f}{r['of_bandwidth']:>8.1%}", flush=True)

    for tokens in args.tokens:
        x = torch.randn(tokens, cols, generator=g)
        for chunk in [None, *args.chunks]:
            calls = rate(lambda i: quant.mxfp4_linear(x, packed[i], scales[i], rows_per_chunk=chunk), n_mx,
                         args.seconds, clock)
            record("mxfp4_linear", tokens, mx_bytes, calls, rows_per_chunk=chunk or "auto")
        if args.baseline:
            record("mxfp4 lut baseline", tokens, mx_bytes,
                   rate(lambda i: lut_baseline(x, packed[i], scales[i]), n_mx, args.seconds, clock))
    del packed, scales

    for dtype in (torch.bfloat16, torch.float32):
        nbytes = rows * cols * torch.tensor([], dtype=dtype).element_size()
        n_w = copies_for(nbytes, footprint)
        weights = clones(torch.randn(rows, cols, generator=g).to(dtype), n_w)
        for tokens in args.tokens:
            x = torch.randn(tokens, cols, generator=g).to(dtype)
            calls = rate(lambda i: torch.mm(x, weights[i].T), n_w, args.seconds, clock)
            record(f"torch mm {str(dtype).removeprefix('torch.')}", tokens, nbytes, calls)
        del weights

    print(json.dumps({"bandwidth_Bps": bandwidth, "rows": rows, "cols": cols, "threads": torch.get_num_threads(),
                      "clock": "thread_cpu" if args.cpu_time else "wall", "results": results}))


if __name__ == "__main__":
    main()
