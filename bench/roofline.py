"""Roofline run for issue #4: a synthetic qwen3_moe whose routed experts are `--oversubscription` times the RAM
they may use, decoded from a cold page cache, against the disk's own direct-I/O bandwidth measured in the same run.

Writes the checkpoint with `moestream synth` (medium preset: 16 layers x 64 experts of 3 MiB, top-8) if DIR has
none, then runs `moestream.bench` once per variant side by side and prints one JSON line per run. Usage:
    python bench/roofline.py DIR [--oversubscription 4] [--gen-len 24] [--variants base,no-lookahead]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "base": [],  # the defaults: lookahead on, reading ahead the best-ranked non-resident prediction per step
    "no-lookahead": ["--no-lookahead"],
    "lookahead-2": ["--lookahead-reads", "2"],
    "lookahead-3": ["--lookahead-reads", "3"],
    "buffered": ["--buffered-io"],
    "lfru": ["--policy", "lfru"],
    "heat": ["--policy", "heat"],
}


def budget_for(path: Path, oversubscription: float) -> int:
    """Dense weights + compute scratch + experts / oversubscription: the cache holds 1/oversubscription of them."""
    from moestream.engine.engine import plan

    p = plan(path)
    return p.dense_bytes + p.scratch_bytes + int(p.expert_bytes / oversubscription)


def run_variant(path: Path, budget: int, extra: list[str], args: argparse.Namespace) -> dict:
    """One bench run in a fresh process (so peak RSS is that run's own)."""
    cmd = [sys.executable, "-m", "moestream", "bench", str(path), "--ram-budget", str(budget), "--cold", "--json",
           "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--temperature",
           str(args.temperature), "--seed", str(args.seed)] + (["--threads", str(args.threads)] if args.threads else [])
    out = subprocess.run(cmd + extra, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--oversubscription", type=float, default=4.0)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0, help="random weights loop under greedy; sample")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="base,no-lookahead")
    ap.add_argument("--repeat", type=int, default=1, help="alternate the variants this many rounds")
    args = ap.parse_args(argv)
    if not (args.dir / "config.json").exists():
        from moestream.synth import synthesize

        synthesize("qwen3_moe", args.dir, "medium")
    budget = budget_for(args.dir, args.oversubscription)
    keep = ("decode_tokens_per_s", "bytes_read_per_token", "expert_hit_rate", "read_bandwidth_bytes_per_s",
            "disk_bandwidth_bytes_per_s", "io_roofline_fraction", "peak_rss_bytes", "interpreter_rss_bytes",
            "ram_budget_bytes", "decode_phases_s", "prefill_tokens_per_s", "ttft_s")
    for rnd in range(args.repeat):
        for name in args.variants.split(","):
            r = run_variant(args.dir, budget, VARIANTS[name], args)
            print(json.dumps({"variant": name, "round": rnd, **{k: r[k] for k in keep},
                              "prefetch": {k: r["prefetch"][k] for k in ("reads", "used")}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
