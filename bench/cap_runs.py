"""The RAM budget under a kernel cap: one model, `moestream bench` twice in child processes, each in its own memory
cgroup: first uncapped (same --ram-budget, the group only measures), then capped at budget + this interpreter's
RSS + ALLOWANCE (page cache included). Greedy, so both must generate the same ids. Prints one table (cap, peak,
failcnt, OOM kill, tokens equal, prefill and decode tok/s) and, for each run, where its memory was at the peak
(anonymous vs page cache from the group, the child's Python stack at its RSS high-water mark).

    flock /work/bench.lock python bench/cap_runs.py MODEL --ram-budget 4.5GiB [--allowance 512MiB]
        [--prompt-len 512] [--gen-len 64] [--cold] [--json]

Exit status 0 when the capped run finished without an OOM kill and with the uncapped run's tokens, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moestream.bench import BenchOptions, bench_in_cgroup
from moestream.cgroup import DEFAULT_ALLOWANCE, cap_for, rss_now
from moestream.config import format_bytes, parse_bytes


def one(model: Path, opts: BenchOptions, cap: int | None, label: str) -> dict:
    report, run = bench_in_cgroup(model, opts, cap)
    row = {"run": label, **run.summary(), "diagnosis": run.describe(),
           "stderr_tail": run.stderr.strip()[-800:] if report is None else ""}
    if report is not None:
        row.update({k: report[k] for k in ("generated_ids", "decode_tokens_per_s", "prefill_tokens_per_s",
                                           "ttft_s", "peak_rss_bytes", "interpreter_rss_bytes", "expert_hit_rate")})
    return row


def table(rows: list[dict]) -> str:
    ref = rows[0].get("generated_ids") if rows[0]["run"] == "uncapped" else None
    head = f"{'run':<9} {'cap':>11} {'peak':>11} {'failcnt':>8} {'oom':>4} {'tokens equal':>13} " \
           f"{'prefill tok/s':>14} {'decode tok/s':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ids = r.get("generated_ids")
        same = "reference" if r is rows[0] and ref is not None else \
            "n/a" if ids is None or ref is None else ("yes" if ids == ref else "NO")
        cap = "none" if r["cap_bytes"] is None else format_bytes(r["cap_bytes"])
        speed = (f"{r['prefill_tokens_per_s']:>14.2f} {r['decode_tokens_per_s']:>13.3f}" if ids is not None
                 else f"{'-':>14} {'-':>13}")
        lines.append(f"{r['run']:<9} {cap:>11} {format_bytes(r['peak_bytes']):>11} {r['failcnt']:>8} "
                     f"{'YES' if r['oom_killed'] else 'no':>4} {same:>13} {speed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--ram-budget", required=True)
    ap.add_argument("--allowance", default=f"{DEFAULT_ALLOWANCE >> 20}MiB")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--cold", action="store_true", help="evict the model's files from the page cache before each run")
    ap.add_argument("--probe", action="store_true", help="run bench's disk probes too (slower)")
    ap.add_argument("--only-capped", action="store_true", help="skip the uncapped reference run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    budget = parse_bytes(args.ram_budget)
    opts = BenchOptions(ram_budget=budget, prompt_len=args.prompt_len, gen_len=args.gen_len, cold=args.cold,
                        probe=args.probe)
    baseline = rss_now()  # this interpreter has imported torch and moestream.bench, as the child has before it opens
    cap = cap_for(budget, baseline, parse_bytes(args.allowance))
    print(f"{args.model}: budget {format_bytes(budget)} + interpreter {format_bytes(baseline)} + allowance "
          f"{args.allowance} = cap {format_bytes(cap)}; prompt {args.prompt_len}, decode {args.gen_len}, greedy",
          flush=True)
    rows = [] if args.only_capped else [one(args.model, opts, None, "uncapped")]
    rows.append(one(args.model, opts, cap, "capped"))
    print(table(rows))
    for r in rows:
        print(f"\n[{r['run']}] {r['diagnosis']}" + (f"\n{r['stderr_tail']}" if r["stderr_tail"] else ""))
    if args.json:
        print(json.dumps(rows))
    capped = rows[-1]
    ok = not capped["oom_killed"] and capped.get("generated_ids") is not None and \
        (args.only_capped or capped["generated_ids"] == rows[0].get("generated_ids"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
