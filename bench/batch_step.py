"""Where one large batch step's time goes (issue #11): B sequences decoding together on a checkpoint at a budget of
dense + scratch + a quarter of the experts + their state, a few timed decode steps after a short prefill.

    python bench/batch_step.py /work/synth/q3m_med --batch 256 [--prompt-len 4] [--steps 2] [--profile]
        [--batch-invariant | --alternate]

Reports per step: wall, I/O wait and expert time (the runner's own clocks), attention (models' attend calls),
bytes read and the disk's rate while reading, and the step roofline (bytes / --disk-bw vs FLOPs / the fp32 matmul
rate measured here). --profile adds a cProfile table of the last step (cumulative time, top functions);
--timeline records every expert read and MoE layer run (bench/io_timeline.py's Recorder) and splits each step's
disk-idle time into: inside MoE layer runs, between them (attention, dense projections, routers), and before the
first / after the last layer run of the step (embedding, LM head).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import moestream  # noqa: F401  # before torch: its OpenMP runtime's wait policy (moestream/omp.py)
import torch

from moestream.config import KV_DTYPE_NAMES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_throughput import FlopModel, Step, default_budget, matmul_rate  # noqa: E402
from io_timeline import Recorder, busy_time  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, nargs="?", default=Path("/work/synth/q3m_med"))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--disk-bw", type=float, default=1.2e9, help="bytes/s for the I/O floor")
    ap.add_argument("--state-per-seq", type=int, default=4 << 20, help="bytes of state room per sequence")
    ap.add_argument("--budget", type=float, default=None,
                    help="RAM budget in bytes (default: dense + scratch + experts / 4 + the state room; 0: none, "
                         "so steps after the first run with every expert resident: the compute alone)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="profile the main thread's CPU time instead of wall time")
    ap.add_argument("--timeline", action="store_true", help="where in each step the disk sat idle")
    ap.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES, default="fp32")
    ap.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="many-row products' precision (EngineOptions.compute_dtype)")
    ap.add_argument("--mixed", type=int, default=0, metavar="P",
                    help="each timed step also prefills P new sequences' whole prompts of --mixed-len tokens beside "
                         "the B decoding rows (the mixed steps of a batch job that admits as others finish)")
    ap.add_argument("--mixed-len", type=int, default=64)
    ap.add_argument("--batch-invariant", action="store_true",
                    help="compute batch-invariantly (EngineOptions.batch_invariant, kernels/invariant.py)")
    ap.add_argument("--alternate", action="store_true",
                    help="A/B in one run: the timed steps alternate without and with batch invariance (off first)")
    args = ap.parse_args(argv)
    rec = Recorder() if args.timeline else None
    if rec is not None:
        rec.install()
    from moestream import Engine

    budget = default_budget(args.model) + args.batch * args.state_per_seq if args.budget is None else \
        (int(args.budget) or None)
    eng = Engine.open(args.model, budget, threads=args.threads, kv_dtype=args.kv_dtype,
                      compute_dtype=args.compute_dtype, batch_invariant=args.batch_invariant)
    rate = matmul_rate(torch.float32)
    flops = FlopModel.of(eng)
    gen = torch.Generator().manual_seed(0)
    states = [eng.new_sequence() for _ in range(args.batch)]
    prompts = torch.randint(3, eng.vocab_size, (args.batch, args.prompt_len), generator=gen).tolist()
    t = time.perf_counter()
    per = max(1, 2048 // args.prompt_len)
    for i in range(0, args.batch, per):
        for _ in eng.step(list(zip(states[i:i + per], prompts[i:i + per]))):  # logits read, as a scheduler does
            pass
    prefill_s = time.perf_counter() - t
    nxt = [[int(torch.randint(3, eng.vocab_size, (1,), generator=gen))] for _ in states]
    out = {"batch": args.batch, "batch_invariant": args.batch_invariant, "budget": budget, "prefill_s": prefill_s, "fp32_flops_per_s": rate, "steps": []}
    for k in range(args.steps):
        fresh = [(eng.new_sequence(), torch.randint(3, eng.vocab_size, (args.mixed_len,), generator=gen).tolist())
                 for _ in range(args.mixed)]
        r, stats = eng.runner.times, eng.plan.store.reader.stats
        before = (r.io_wait_s, r.expert_s, r.lookahead_s, eng.plan.store.bytes_read, stats.busy_s, time.thread_time(),
                  time.process_time())
        if args.alternate:
            eng.options.batch_invariant = k % 2 == 1
        last = args.profile and k == args.steps - 1
        prof = (cProfile.Profile(time.thread_time) if args.cpu else cProfile.Profile()) if last else None
        t = time.perf_counter()
        t_rec = rec.now() if rec is not None else 0.0
        if prof:
            prof.enable()
        for _ in eng.step(list(zip(states, nxt)) + fresh):  # the logits read (a chunk at a time), as a scheduler does
            pass
        if prof:
            prof.disable()
        wall = time.perf_counter() - t
        main_cpu, proc_cpu = time.thread_time() - before[5], time.process_time() - before[6]
        nbytes = eng.plan.store.bytes_read - before[3]
        rows = args.batch + args.mixed * args.mixed_len
        s = Step(wall, nbytes, rows, args.batch + args.mixed, args.batch * (args.prompt_len + k + 1) +
                 args.mixed * args.mixed_len * (args.mixed_len + 1) // 2, args.batch)
        f = flops.step(s)
        out["steps"].append({
            "wall_s": wall, "io_wait_s": r.io_wait_s - before[0], "expert_s": r.expert_s - before[1],
            "lookahead_s": r.lookahead_s - before[2], "main_thread_cpu_s": main_cpu, "process_cpu_s": proc_cpu,
            "bytes_read": nbytes, "disk_busy_s": stats.busy_s - before[4],
            "read_rate_while_busy": nbytes / max(1e-9, stats.busy_s - before[4]), "flops": f,
            "io_floor_s": nbytes / args.disk_bw, "compute_floor_s": f / rate,
            "roofline_fraction": max(nbytes / args.disk_bw, f / rate) / wall,
            "hit_rate": eng.stats["expert_hit_rate"], "rows": rows,
            "batch_invariant": eng.options.batch_invariant})
        if rec is not None:
            out["steps"][-1]["disk_idle"] = idle_split(rec, t_rec, rec.now())
        if prof:
            out["profile_tottime"] = _table(prof, "tottime", 25)
            out["profile_cumulative"] = _table(prof, "cumulative", 40)
        for st, _ in fresh:
            st.release()
    prof_text = (out.pop("profile_tottime", ""), out.pop("profile_cumulative", ""))
    print(json.dumps(out, indent=1))
    for p in prof_text:
        print(p)
    return 0


def idle_split(rec: Recorder, a: float, b: float) -> dict:
    """Seconds of [a, b) with no read in flight, split by where the step was: inside a MoE layer run, between two
    of them, or before the first / after the last one."""
    runs = sorted((s, e) for s, e, _ in rec.moe if a <= s < b)
    if not runs:
        return {}
    spans = {"in_moe": runs, "between_moe": [(runs[i][1], runs[i + 1][0]) for i in range(len(runs) - 1)],
             "step_edges": [(a, runs[0][0]), (runs[-1][1], b)]}
    out = {k: sum((e - s) - busy_time(rec.reads, s, e)[0] for s, e in v if e > s) for k, v in spans.items()}
    out["moe_runs"], out["in_moe_s"] = len(runs), sum(e - s for s, e in runs)
    return out


def _table(prof: cProfile.Profile, key: str, n: int) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(n)
    return buf.getvalue()


if __name__ == "__main__":
    sys.exit(main())
