"""`moestream plan` against measurement (issue #12 item 5): predicted and measured decode tok/s per model and
budget, and batch throughput for one model, side by side in one run.

    flock /work/bench.lock python bench/plan_accuracy.py MODEL... --budgets e0.25,e0.5,e1 [--batch 8]
        [--prompt-len 64] [--gen-len 16] [--skew 0] [--reuse R] [--json]

Budgets: bytes ("1.5GB") or `eF`: every dense weight resident plus the share F of the expert bytes. For each
model the planner calibrates once (`plan --calibrate`: kernels, matmul, engine overhead, disk); then per budget
the disk is probed again right before the cold `moestream bench` (the disk here drifts +-40% within minutes) and
plan predicts with that probe. A second prediction uses the bench's own before/after probe mean (`ratio_benchdisk`),
separating the disk's drift from the model's error. With --batch N, the last model's first budget also runs N
requests through the server Scheduler (bench/batch_throughput.py) against plan's batch prediction.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PY = sys.executable


def _run(cmd: list[str]) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def budget_bytes(model: Path, spec: str) -> int:
    from moestream.config import parse_bytes
    from moestream.info import model_info

    if spec.startswith("e"):
        i = model_info(model)
        return int(i.all_resident_budget + float(spec[1:]) * i.expert_bytes * 1.02)  # 2%: read alignment
    return int(parse_bytes(spec))


def probe(model: Path) -> float:
    from moestream.bench import PROBE_THREADS, model_files, probe_disk

    return probe_disk(model_files(model), PROBE_THREADS)


def plan(model: Path, budget: int, args, disk: float | None, calibrate: bool = False, batch: int | None = None) -> dict:
    cmd = [PY, "-m", "moestream", "plan", str(model), "--json", "--ram-budget", str(budget), "--prompt-len",
           str(args.prompt_len), "--gen-len", str(args.gen_len), "--skew", str(args.skew), "--reuse", str(args.reuse)]
    cmd += ["--disk-bandwidth", str(int(disk))] if disk else []
    cmd += ["--calibrate"] if calibrate else []
    cmd += ["--batch", str(batch)] if batch else []
    return _run(cmd)


def bench(model: Path, budget: int, args) -> dict:
    return _run([PY, "-m", "moestream", "bench", str(model), "--cold", "--json", "--ram-budget", str(budget),
                 "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--temperature", "1.0",
                 "--seed", "0"])


def batch(model: Path, budget: int, args) -> dict:
    here = Path(__file__).resolve().parent
    return _run([PY, str(here / "batch_throughput.py"), str(model), "--json", "--budget", str(budget),
                 "--requests", str(args.batch), "--max-batch", str(args.batch), "--prompt-len", str(args.prompt_len),
                 "--gen-len", str(args.batch_gen_len), "--single-gen-len", "0", "--threads", str(args.threads)])


def row(model: Path, spec: str, budget: int, pred: dict, pred_b: dict, meas: dict) -> dict:
    m = meas["decode_tokens_per_s"]
    return {"model": model.name, "budget": spec, "budget_bytes": budget,
            "predicted": pred["decode_tokens_per_s"], "measured": m, "ratio": pred["decode_tokens_per_s"] / m,
            "predicted_benchdisk": pred_b["decode_tokens_per_s"],
            "ratio_benchdisk": pred_b["decode_tokens_per_s"] / m,
            "hit_predicted": pred["expert_hit_rate"], "hit_measured": meas["expert_hit_rate"],
            "bytes_per_token_predicted": pred["disk_bytes_per_token"], "bytes_per_token_measured":
            meas["bytes_read_per_token"], "disk_probe": pred["rates"]["disk"],
            "disk_bench": meas["disk_bandwidth_bytes_per_s"], "step_predicted": pred["decode_step"],
            "prefill_predicted": pred["prefill_cold_tokens_per_s"], "prefill_measured": meas["prefill_tokens_per_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--budgets", default="e0.25,e0.5,e1")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--skew", type=float, default=0.64,
                    help="Zipf exponent to plan with (default 0.64: `moestream trace` of a synthetic qwen3_moe)")
    ap.add_argument("--reuse", type=float, default=0.25,
                    help="P(reuse next) to plan with (`moestream trace` of the synthetic family; see docs/plan.md)")
    ap.add_argument("--batch", type=int, default=0, help="also measure N sequences on the last model")
    ap.add_argument("--batch-gen-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="batch run's torch threads (the engine default here)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows, batch_rows = [], []
    for model in args.models:
        for i, spec in enumerate(args.budgets.split(",")):
            budget = budget_bytes(model, spec)
            disk = probe(model)
            pred = plan(model, budget, args, disk, calibrate=i == 0)
            meas = bench(model, budget, args)
            pred_b = plan(model, budget, args, meas["disk_bandwidth_bytes_per_s"])
            rows.append(row(model, spec, budget, pred, pred_b, meas))
            print(_line(rows[-1]), file=sys.stderr, flush=True)
    if args.batch:
        model, spec = args.models[-1], args.budgets.split(",")[0]
        budget = budget_bytes(model, spec)
        disk = probe(model)
        pred = plan(model, budget, args, disk, batch=args.batch)
        meas = batch(model, budget, args)
        m = meas["decode_only_tokens_per_s"]
        batch_rows.append({"model": model.name, "budget": spec, "batch": args.batch,
                           "predicted": pred["batch_tokens_per_s"], "measured": m,
                           "ratio": pred["batch_tokens_per_s"] / m, "step_predicted": pred["batch_step"],
                           "bytes_per_token_measured": meas["bytes_read_per_generated_token"],
                           "disk_bench": meas["disk_bandwidth_bytes_per_s"]})
    print(json.dumps({"decode": rows, "batch": batch_rows}, indent=1) if args.json else _table(rows, batch_rows))
    return 0


def _line(r: dict) -> str:
    return (f"{r['model']:<12} {r['budget']:<6} {r['predicted']:>9.3f} {r['measured']:>9.3f} {r['ratio']:>6.2f} "
            f"{r['ratio_benchdisk']:>6.2f}  hit {r['hit_predicted']:.2f}/{r['hit_measured']:.2f}  "
            f"MB/tok {r['bytes_per_token_predicted'] / 1e6:.0f}/{r['bytes_per_token_measured'] / 1e6:.0f}  "
            f"disk {r['disk_probe'] / 1e9:.2f}/{r['disk_bench'] / 1e9:.2f} GB/s")


def _table(rows: list[dict], batch_rows: list[dict]) -> str:
    out = ["model        budget  pred tok/s  meas tok/s  ratio  ratio(bench disk)  hit pred/meas  MB/token pred/meas"
           "  disk probe/bench"]
    out += [_line(r) for r in rows]
    for b in batch_rows:
        out.append(f"batch {b['batch']} on {b['model']} {b['budget']}: predicted {b['predicted']:.3f} tok/s, "
                   f"measured {b['measured']:.3f} tok/s, ratio {b['ratio']:.2f}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
