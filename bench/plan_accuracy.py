"""`moestream plan` against measurement (issue #12 item 5): predicted and measured decode tok/s per model and
budget, and batch throughput, side by side in one run.

    flock /work/bench.lock python bench/plan_accuracy.py MODEL... --budgets e0.25,e0.5,e1 [--batch 8]
        [--prompt-len 64] [--gen-len 16] [--skew 0.64] [--reuse 0.25] [--kv-dtype int8] [--compute-dtype bf16]
        [--out RESULTS.json] [--json]
    python bench/plan_accuracy.py --replan RESULTS.json [--json]

Budgets: bytes ("1.5GB") or `eF`: every dense weight resident plus the share F of the expert bytes. For each
model the planner calibrates once (`plan --calibrate`: kernels, matmul, engine overhead, disk) into a calibration
file of this run (`--out` with the suffix `.cal/MODEL.json`, MOESTREAM_PLAN_CALIBRATION), so that the rates
behind a prediction are the ones measured in the same locked run as the measurement. Per budget the disk is probed again right
before the cold `moestream bench` (the disk here drifts +-40% within minutes) and plan predicts with that probe;
a second prediction uses the bench's own before/after probe mean (`ratio_benchdisk`), separating the disk's
drift from the model's error. With --batch N, each model's first budget also runs N requests through the server
Scheduler (bench/batch_throughput.py, whose `step_detail` has each engine step's rows, reads, misses and the
runner's io wait / expert seconds) against plan's batch prediction: at N (against the steps where the most rows decoded together)
and at each decode step's own row count (against the run's decode-only rate); `--batch-only` skips the
one-stream benches.

Every measurement (the bench's and batch run's JSON, the probes) is kept in RESULTS.json, so `--replan` predicts
again with the current planner and the run's own calibration, without measuring anything: a change to the model
is checked against the same measurements, term by term (bytes read, hit rate, the bench's phase times).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable


class RunFailed(RuntimeError):
    pass


SPIN_ENV: dict[str, str] = {}  # --spin-us: MOESTREAM_NATIVE_SPIN_US for every measuring subprocess


def _run(cmd: list[str], cal: Path | None = None) -> dict:
    env = dict(os.environ, **SPIN_ENV, **({"MOESTREAM_PLAN_CALIBRATION": str(cal)} if cal else {}))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RunFailed(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def budget_bytes(model: Path, spec: str) -> int:
    from moestream.config import parse_bytes
    from moestream.info import model_info

    if spec.startswith("e"):
        i = model_info(model)
        return int(i.all_resident_budget + float(spec[1:]) * i.expert_bytes * 1.02)  # 2%: read alignment
    return int(parse_bytes(spec))


def probe(model: Path) -> float:
    """The planner's own disk probe (calibrate.disk_rate: the buffers an expert cache's reads would land in)."""
    from moestream.bench import PROBE_SECONDS, model_files
    from moestream.planner.calibrate import disk_rate

    return disk_rate(model_files(model), PROBE_SECONDS)


def probe_stream(model: Path) -> float:
    """The planner's stream probe (calibrate.stream_rate: streamed dense weights into kept huge-page buffers)."""
    from moestream.bench import PROBE_SECONDS, model_files
    from moestream.planner.calibrate import stream_rate

    return stream_rate(model_files(model), PROBE_SECONDS)


def skew_args(a: dict, model: str) -> list[str]:
    """--skew-from the model's routing report (a file, or DIR/MODEL.json) when the run has one, else --skew /
    --reuse."""
    src = a.get("skew_from")
    if src:
        path = Path(src)
        return ["--skew-from", str(path / f"{Path(model).name}.json" if path.is_dir() else path)]
    return ["--skew", str(a["skew"]), "--reuse", str(a["reuse"])]


def plan(run: dict, disk: float | None, calibrate: bool = False, batch: int | None = None,
         stream: float | None = None) -> dict:
    a = run["args"]
    cmd = [PY, "-m", "moestream", "plan", run["model"], "--json", "--ram-budget", str(run["budget_bytes"]),
           "--prompt-len", str(a["prompt_len"]), "--gen-len", str(a["batch_gen_len"] if batch else a["gen_len"]),
           *skew_args(a, run["model"])]
    cmd += ["--disk-bandwidth", str(int(disk))] if disk else []
    cmd += ["--stream-bandwidth", str(int(stream))] if stream else []
    cmd += ["--calibrate"] if calibrate else []
    cmd += ["--batch", str(batch)] if batch else []
    cmd += dtype_args(a)
    return _run(cmd, Path(run["calibration"]))


def dtype_args(a: dict) -> list[str]:
    """--kv-dtype / --compute-dtype of the run (plan, bench and the batch run alike; absent in older results)."""
    return ["--kv-dtype", a.get("kv_dtype") or "fp32", "--compute-dtype", a.get("compute_dtype") or "fp32"]


def cpu_busy() -> tuple[float, float]:
    """(seconds all CPUs were busy since boot, this process's children's CPU seconds): /proc/stat and rusage."""
    import resource

    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    busy = (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, ru.ru_utime + ru.ru_stime


def bench(model: Path, budget: int, a: dict) -> dict:
    (b0, c0), t0 = cpu_busy(), time.perf_counter()
    out = _run([PY, "-m", "moestream", "bench", str(model), "--cold", "--json", "--ram-budget", str(budget),
                "--prompt-len", str(a["prompt_len"]), "--gen-len", str(a["gen_len"]), "--temperature", "1.0",
                "--seed", "0", *dtype_args(a)])
    (b1, c1), wall = cpu_busy(), time.perf_counter() - t0
    out.pop("generated_ids", None)
    # CPUs busy with other processes while the bench ran (niced ones included): a shared two-core machine's
    # scheduler delays the engine's pool workers behind them (docs/plan.md, "Warm decode is bimodal")
    out["other_cpu_load"] = max(0.0, (b1 - b0) - (c1 - c0)) / wall
    return out


def batch(model: Path, budget: int, a: dict) -> dict:
    here = Path(__file__).resolve().parent
    return _run([PY, str(here / "batch_throughput.py"), str(model), "--json", "--budget", str(budget),
                 "--requests", str(a.get("batch_requests") or a["batch"]), "--max-batch", str(a["batch"]),
                 "--prompt-len", str(a["prompt_len"]),
                 "--gen-len", str(a["batch_gen_len"]), "--single-gen-len", "0", "--threads", str(a["threads"]),
                 *dtype_args(a)])


# ---- predictions from saved measurements -------------------------------------------------------------------------
def predict_decode(run: dict, calibrate: bool = False) -> dict:
    """Fill in a decode run's predictions: with the pre-bench probe, and with the bench's own probe mean."""
    meas = run["bench"]
    run["plan"] = plan(run, run["disk_probe"], calibrate, stream=run.get("stream_probe"))
    run["plan_benchdisk"] = plan(run, meas["disk_bandwidth_bytes_per_s"],
                                 stream=meas.get("disk_stream_bandwidth_bytes_per_s") or run.get("stream_probe"))
    # a diagnostic, not a prediction: the disk rate the bench's own reads got (bytes over the time any was in
    # flight, their buffers' page faults included), where the probes around the bench disagree; streamed dense
    # weights stay at the stream probe's rate
    if meas.get("read_bandwidth_bytes_per_s"):
        run["plan_readdisk"] = plan(run, meas["read_bandwidth_bytes_per_s"], stream=run.get("stream_probe"))
    return run


def decode_steps(meas: dict) -> list[dict]:
    """The batch run's decode-only steps (every row decoding), from its step_detail (absent in older runs)."""
    return [s for s in meas.get("step_detail") or () if s["decode_rows"] > 0]


def predict_batch(run: dict) -> dict:
    disk = run["batch_run"]["disk_bandwidth_bytes_per_s"]
    run["plan"] = plan(run, disk, batch=run["args"]["batch"])
    # each row count the run's decode steps had (sequences finish at different steps): the measured decode-only
    # rate's own prediction
    counts = sorted({s["decode_rows"] for s in decode_steps(run["batch_run"])})
    run["plan_rows"] = {str(n): plan(run, disk, batch=n)["batch_step"] for n in counts if n > 1}
    # a diagnostic of the disk's drift, not a prediction: the widest steps predicted at each of the run's own disk
    # probes (before and after it) instead of their mean
    probes = run["batch_run"].get("disk_probes_bytes_per_s") or []
    if counts and len(probes) > 1:
        run["plan_probes"] = [plan(run, p, batch=counts[-1])["batch_step"] for p in probes]
    return run


def decode_row(run: dict) -> dict:
    pred, pred_b, meas = run["plan"], run["plan_benchdisk"], run["bench"]
    m = meas["decode_tokens_per_s"]
    ph = meas["decode_phases_s"]
    n = len(meas["per_token"])  # the decode tokens the bench timed (the phases are their sums)
    return {"model": Path(run["model"]).name, "budget": run["spec"], "budget_bytes": run["budget_bytes"],
            "predicted": pred["decode_tokens_per_s"], "measured": m, "ratio": pred["decode_tokens_per_s"] / m,
            "predicted_benchdisk": pred_b["decode_tokens_per_s"], "ratio_benchdisk": pred_b["decode_tokens_per_s"] / m,
            "ratio_readdisk": run["plan_readdisk"]["decode_tokens_per_s"] / m if "plan_readdisk" in run else None,
            "disk_read": meas.get("read_bandwidth_bytes_per_s"),
            "hit_predicted": pred["expert_hit_rate"], "hit_measured": meas["expert_hit_rate"],
            # expert reads and the dense streamer's reads, each predicted / measured
            "bytes_per_token_predicted": pred["disk_bytes_per_token"] - pred["streamed_dense_bytes_per_step"],
            "streamed_dense_bytes_per_token": pred["streamed_dense_bytes_per_step"],
            "streamed_dense_bytes_per_token_measured": meas.get("streamed_dense_bytes_per_token"),
            "bytes_per_token_measured": meas["bytes_read_per_token"], "disk_probe": pred["rates"]["disk"],
            "disk_bench": meas["disk_bandwidth_bytes_per_s"], "step_predicted": pred_b["decode_step"],
            "stream_probe": run.get("stream_probe"), "stream_bench": meas.get("disk_stream_bandwidth_bytes_per_s"),
            "phases_measured_per_token": {k: (v / n if v is not None else None) for k, v in ph.items()},
            "prefill_predicted": pred_b["prefill_cold_tokens_per_s"], "prefill_measured": meas["prefill_tokens_per_s"],
            "other_cpu_load": meas.get("other_cpu_load")}


def batch_row(run: dict) -> dict:
    pred, meas = run["plan"], run["batch_run"]
    m = meas["decode_only_tokens_per_s"]
    row = {"model": Path(run["model"]).name, "budget": run["spec"], "batch": run["args"]["batch"],
           "kv_dtype": run["args"].get("kv_dtype") or "fp32",
           "compute_dtype": run["args"].get("compute_dtype") or "fp32",
           "predicted": pred["batch_tokens_per_s"], "measured": m, "ratio": pred["batch_tokens_per_s"] / m,
           "step_predicted": pred["batch_step"], "hit_measured": meas["expert_hit_rate"],
           "bytes_per_token_measured": meas["bytes_read_per_generated_token"],
           "disk_bench": meas["disk_bandwidth_bytes_per_s"], "other_cpu_load": meas.get("other_cpu_load"),
           "sequences_predicted": pred.get("batch_sequences")}
    steps = decode_steps(meas)
    plans = run.get("plan_rows") or {}
    if steps:
        widest = max(s["decode_rows"] for s in steps)
        full = [s for s in steps if s["decode_rows"] == widest]
        n = len(full)
        row.update({"widest_rows": widest, "full_steps": n,
                    "measured_full": sum(s["decode_rows"] for s in full) / sum(s["seconds"] for s in full),
                    "full_step_measured": {k: sum(s[k] for s in full) / n for k in
                                           ("seconds", "io_wait_s", "expert_s", "lookahead_s", "misses",
                                            "bytes_read")}})
        if all(str(s["decode_rows"]) in plans for s in steps):
            secs = sum(plans[str(s["decode_rows"])]["seconds"] for s in steps)
            row["predicted_steps"] = sum(s["decode_rows"] for s in steps) / secs
            row["ratio_steps"] = row["predicted_steps"] / m
            if str(widest) in plans:
                row["predicted_full"] = widest / plans[str(widest)]["seconds"]
                row["ratio_full"] = row["predicted_full"] / row["measured_full"]
                row["step_predicted_full"] = plans[str(widest)]
                if run.get("plan_probes"):
                    row["predicted_full_at_probes"] = [widest / p["seconds"] for p in run["plan_probes"]]
                    row["disk_probes"] = meas.get("disk_probes_bytes_per_s")
    return row


# ---- the measured run --------------------------------------------------------------------------------------------
def measure(args) -> dict:
    a = {k: getattr(args, k) for k in ("prompt_len", "gen_len", "skew", "reuse", "batch", "batch_gen_len",
                                        "batch_requests", "threads", "spin_us", "kv_dtype", "compute_dtype")}
    if args.skew_from:
        a["skew_from"] = str(args.skew_from.resolve())
    cal = args.out.with_suffix(".cal") if args.out else Path(f"plan-accuracy-{int(time.time())}.cal")
    out = {"args": a, "decode": [], "batch": [], "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for model in args.models:
        specs = args.budgets.split(",")
        if args.batch_only:
            if args.batch and not args.keep_calibration:
                calibrate(out, {"model": str(model), "budget_bytes": budget_bytes(model, specs[0]), "args": a,
                                "calibration": str(cal.resolve() / f"{model.name}.json")})
            specs_decode: list[str] = []
        else:
            specs_decode = specs
        for i, spec in enumerate(specs_decode):
            run = {"model": str(model), "spec": spec, "budget_bytes": budget_bytes(model, spec), "args": a,
                   "calibration": str(cal.resolve() / f"{model.name}.json")}
            if i == 0 and not args.keep_calibration:  # calibrate before anything else of this model, in this run
                calibrate(out, run)
            run["disk_probe"] = probe(model)
            run["stream_probe"] = probe_stream(model)
            try:
                run["bench"] = bench(model, run["budget_bytes"], a)
            except RunFailed as e:  # a budget the engine refuses: said, and the other budgets still run
                out.setdefault("failed", []).append(str(e)[-600:])
                print(e, file=sys.stderr, flush=True)
                continue
            out["decode"].append(predict_decode(run))
            print(_line(decode_row(run)), file=sys.stderr, flush=True)
            _save(args.out, out)  # a later failure keeps what was measured
        if args.batch:
            run = {"model": str(model), "spec": specs[0], "budget_bytes": budget_bytes(model, specs[0]), "args": a,
                   "calibration": str(cal.resolve() / f"{model.name}.json")}
            try:
                (b0, c0), t0 = cpu_busy(), time.perf_counter()
                run["batch_run"] = batch(model, run["budget_bytes"], a)
                (b1, c1), wall = cpu_busy(), time.perf_counter() - t0
                run["batch_run"]["other_cpu_load"] = max(0.0, (b1 - b0) - (c1 - c0)) / wall
            except RunFailed as e:
                out.setdefault("failed", []).append(str(e)[-600:])
                print(e, file=sys.stderr, flush=True)
                continue
            out["batch"].append(predict_batch(run))
            print(_batch_line(batch_row(run)), file=sys.stderr, flush=True)
            _save(args.out, out)
    return out


def calibrate(out: dict, run: dict) -> None:
    """`plan --calibrate` for the run's model into its calibration file, the other processes' CPU load while it
    probed kept beside it (a probe slowed by load prices every byte and FLOP of the prediction: docs/plan.md)."""
    (b0, c0), t0 = cpu_busy(), time.perf_counter()
    plan(run, 1e9, calibrate=True)
    (b1, c1), wall = cpu_busy(), time.perf_counter() - t0
    load = max(0.0, (b1 - b0) - (c1 - c0)) / wall
    out.setdefault("calibration_other_cpu_load", {})[Path(run["model"]).name] = load
    print(f"calibrated {Path(run['model']).name} in {wall:.0f} s, other load {load:.2f} CPUs", file=sys.stderr,
          flush=True)


def _save(path: Path | None, out: dict) -> None:
    if path:
        path.write_text(json.dumps(out, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, nargs="*")
    ap.add_argument("--budgets", default="e0.25,e0.5,e1")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--skew", type=float, default=0.64,
                    help="Zipf exponent to plan with (default 0.64: `moestream trace` of a synthetic qwen3_moe)")
    ap.add_argument("--reuse", type=float, default=0.25,
                    help="P(reuse next) to plan with (`moestream trace` of the synthetic family; see docs/plan.md)")
    ap.add_argument("--skew-from", type=Path, default=None, metavar="REPORT|DIR",
                    help="plan with the routing measured from each model (`moestream plan MODEL --skew-from model "
                         "--save-skew DIR/MODEL.json`, run before and outside the lock) instead of --skew / --reuse")
    ap.add_argument("--batch", type=int, default=0, help="also measure N sequences on each model's first budget")
    ap.add_argument("--batch-gen-len", type=int, default=8)
    ap.add_argument("--batch-only", action="store_true",
                    help="measure only the batch run (on the first budget), no one-stream benches")
    ap.add_argument("--batch-requests", type=int, default=0, help="requests of the batch run (default: --batch)")
    ap.add_argument("--threads", type=int, default=2, help="batch run's torch threads (the engine default here)")
    ap.add_argument("--kv-dtype", choices=("fp32", "bf16", "int8"), default="fp32",
                    help="KV cache storage of the bench, the batch run and plan (default fp32)")
    ap.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="many-row products' precision of the bench, the batch run and plan (default fp32)")
    ap.add_argument("--spin-us", type=int, default=None,
                    help="MOESTREAM_NATIVE_SPIN_US for the bench, batch and calibration runs (default: the engine's)")
    ap.add_argument("--keep-calibration", action="store_true",
                    help="reuse the calibration file --out already has (measured in an earlier locked run)")
    ap.add_argument("--out", type=Path, default=None, help="write every measurement and prediction here")
    ap.add_argument("--replan", type=Path, default=None, metavar="RESULTS",
                    help="predict again for a saved run (no measurement) and print the table")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print the table as docs/plan.md's markdown rows")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.spin_us is not None:
        SPIN_ENV["MOESTREAM_NATIVE_SPIN_US"] = str(args.spin_us)
    if args.replan:
        out = json.loads(args.replan.read_text())
        if args.skew_from:  # replan the saved measurements with a measured routing
            out["args"]["skew_from"] = str(args.skew_from.resolve())
            for r in out["decode"] + out["batch"]:
                r["args"] = out["args"]
        out["decode"] = [predict_decode(r) for r in out["decode"]]
        out["batch"] = [predict_batch(r) for r in out["batch"]]
    elif args.models:
        out = measure(args)
    else:
        ap.error("give model directories to measure, or --replan RESULTS")
    _save(args.out, out)
    rows, brows = [decode_row(r) for r in out["decode"]], [batch_row(r) for r in out["batch"]]
    loads = out.get("calibration_other_cpu_load") or {}
    if args.json:
        print(json.dumps({"decode": rows, "batch": brows, "calibration_other_cpu_load": loads}, indent=1))
    else:
        print(_markdown(rows, brows) if args.markdown else _table(rows, brows))
        for name, load in loads.items():
            print(f"calibration of {name}: other load {load:.2f} CPUs")
    return 0


def _line(r: dict) -> str:
    return (f"{r['model']:<10} {r['budget']:<6} {r['predicted']:>8.3f} {r['measured']:>8.3f} {r['ratio']:>6.2f} "
            f"{r['predicted_benchdisk']:>8.3f} {r['ratio_benchdisk']:>6.2f}  hit {r['hit_predicted']:.2f}/"
            f"{r['hit_measured']:.2f}  expert MB/tok {r['bytes_per_token_predicted'] / 1e6:.0f}/"
            f"{r['bytes_per_token_measured'] / 1e6:.0f} (+ dense {r['streamed_dense_bytes_per_token'] / 1e6:.0f}/"
            f"{(r.get('streamed_dense_bytes_per_token_measured') or 0) / 1e6:.0f})  "
            f"disk {r['disk_probe'] / 1e9:.2f}/{r['disk_bench'] / 1e9:.2f}"
            + (f"  stream {r['stream_probe'] / 1e9:.2f}/{(r.get('stream_bench') or 0) / 1e9:.2f}"
               if r.get("stream_probe") else "")
            + (f"  other load {r['other_cpu_load']:.2f} CPUs" if r.get("other_cpu_load") is not None else "")
            + (f"  (at its reads' rate {r['disk_read'] / 1e9:.2f}: ratio {r['ratio_readdisk']:.2f})"
               if r.get("ratio_readdisk") else ""))


def _batch_line(b: dict) -> str:
    return (f"batch {b['batch']} on {b['model']} {b['budget']} ({b.get('kv_dtype', 'fp32')} KV, "
            f"{b.get('compute_dtype', 'fp32')} compute): predicted {b['predicted']:.3f} tok/s, measured "
            f"{b['measured']:.3f} tok/s, ratio {b['ratio']:.2f}; MB/token measured "
            f"{b['bytes_per_token_measured'] / 1e6:.0f}, hit {b['hit_measured']:.2f} (predicted "
            f"{b['step_predicted']['hit_rate']:.2f})"
            + (f"; over its decode steps' rows: predicted {b['predicted_steps']:.3f}, ratio {b['ratio_steps']:.2f}"
               if b.get("predicted_steps") else "")
            + (f"; its {b['full_steps']} steps of {b['widest_rows']} rows: measured {b['measured_full']:.3f}, "
               f"predicted {b['predicted_full']:.3f}, ratio {b['ratio_full']:.2f}" if b.get("predicted_full") else "")
            + (" (at the probes before / after the run: " + " / ".join(
                f"{p:.3f} at {d / 1e9:.2f} GB/s" for p, d in zip(b["predicted_full_at_probes"], b["disk_probes"])) + ")"
               if b.get("predicted_full_at_probes") else "")
            + (f"  other load {b['other_cpu_load']:.2f} CPUs" if b.get("other_cpu_load") is not None else ""))


def _markdown(rows: list[dict], batch_rows: list[dict]) -> str:
    out = []
    for r in rows:
        ph = r["phases_measured_per_token"]
        st = r["step_predicted"]
        out.append(f"| {r['model']} | {r['budget']} | {r['predicted']:.3g} | {r['predicted_benchdisk']:.3g} | "
                   f"{r['measured']:.3g} | {100 * (r['ratio_benchdisk'] - 1):+.0f}% | {r['hit_predicted']:.2f} / "
                   f"{r['hit_measured']:.2f} | {r['bytes_per_token_predicted'] / 1e6:.0f} / "
                   f"{r['bytes_per_token_measured'] / 1e6:.0f} | {r['streamed_dense_bytes_per_token'] / 1e6:.0f} / "
                   f"{(r.get('streamed_dense_bytes_per_token_measured') or 0) / 1e6:.0f} | "
                   f"{r['disk_probe'] / 1e9:.2f} / "
                   f"{r['disk_bench'] / 1e9:.2f} | {st['io_s']:.3f} / {st['compute_s']:.3f} / {st['overhead_s']:.3f} | "
                   f"{ph['io_wait_s']:.3f} / {ph['expert_compute_s']:.3f} / {ph['attention_mixer_s'] or 0:.3f} / "
                   f"{ph['other_s']:.3f} |")
    for b in batch_rows:
        if b.get("predicted_full"):  # the batch step's own table (docs/plan.md's batch rows)
            st, fm = b["step_predicted_full"], b["full_step_measured"]
            d = st.get("layer_step") or {}
            out.append(f"| {b['model']} batch {b['batch']} | {b['budget']} | {b['measured']:.3g} | "
                       f"{b['predicted_steps']:.3g} ({100 * (b['ratio_steps'] - 1):+.0f}%) | {b['widest_rows']} x "
                       f"{b['full_steps']} | {b['measured_full']:.3g} | {b['predicted_full']:.3g} "
                       f"({100 * (b['ratio_full'] - 1):+.0f}%) | {st['hit_rate']:.2f} / {b['hit_measured']:.2f} | "
                       f"{st['experts_read']:.0f} / {fm['misses']:.0f} | {st['seconds']:.2f} / {st['io_s']:.2f} / "
                       f"{st['compute_s']:.2f} / {st['compute_parts'].get('experts_s', 0):.2f}"
                       f" | {fm['seconds']:.2f} / {fm['io_wait_s']:.2f} / {fm['expert_s']:.2f} | "
                       f"{d.get('disk_busy_share', 0):.2f} | {b['disk_bench'] / 1e9:.2f} | "
                       f"{b.get('other_cpu_load') or 0:.2f} |")
            continue
        out.append(f"| {b['model']} batch {b['batch']} | {b['budget']} | | {b['predicted']:.3g} | "
                   f"{b['measured']:.3g} | {100 * (b['ratio'] - 1):+.0f}% | {b['step_predicted']['hit_rate']:.2f} / "
                   f"{b['hit_measured']:.2f} "
                   f"| | | | {b['disk_bench'] / 1e9:.2f} | | |")
    return "\n".join(out)


def _table(rows: list[dict], batch_rows: list[dict]) -> str:
    out = ["model      budget  pred   meas    ratio  pred(bench disk) ratio  hit pred/meas  expert MB/token pred/meas"
           " (+ dense streamed)  disk GB/s probe/bench"]
    out += [_line(r) for r in rows] + [_batch_line(b) for b in batch_rows]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
