"""Checkpoint fuzzing at scale (issue 14): N mutated tiny checkpoints opened through the real code paths.

Bases: tiny qwen3_moe (bf16 shards, BPE tokenizer), its packed copy and tiny Kimi K3 (MXFP4 experts). Each case
copies one base, applies 1-3 random edits from moestream.fuzz (safetensors headers, config.json, tokenizer files,
the shard index, the pack manifest) and runs `moestream.fuzz.exercise` in-process: `info`, pack verify, tokenizer
and chat template, Engine.open and 3 generated tokens. Only MoestreamError is allowed; anything else is counted as
a finding (by type and the line that raised it, with one example each). A sample also runs through the CLI in a
subprocess (`moestream info` and `moestream run`): the exit code must be 0 or 2 and stderr hold no traceback; a
signal (a crash) is a finding too. Reports counts as JSON.
    python bench/fuzz_checkpoints.py [--cases 2000] [--cli-sample 100] [--seed 0] [--work DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from moestream.errors import MoestreamError
from moestream.fuzz import TARGETS, exercise, mutate
from moestream.synth import synthesize
from moestream.pack import pack


def make_bases(work: Path) -> dict[str, Path]:
    synthesize("qwen3_moe", work / "qwen", "tiny", cache_dir=work / "cache", progress=False)
    synthesize("kimi-k3", work / "k3", "tiny", cache_dir=work / "cache", progress=False)
    pack(work / "qwen", work / "packed")
    return {"qwen": work / "qwen", "packed": work / "packed", "k3": work / "k3"}


def mutated(src: Path, dst: Path, rng: random.Random) -> list[str]:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    target = rng.choice(TARGETS)
    return [mutate(dst, rng, target if rng.random() < 0.7 else None) for _ in range(rng.randint(1, 3))]


def where(e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__} at {Path(frame.filename).name}:{frame.lineno}"


def run_cli(d: Path) -> str | None:
    """None when both commands exit 0 or 2 without a traceback, else what went wrong."""
    for args in (["info", str(d)], ["run", str(d), "--prompt", "def f(x):", "--max-new", "3"]):
        try:
            done = subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True,
                                  timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        except subprocess.TimeoutExpired:
            return f"{args[0]}: timed out"
        if done.returncode not in (0, 2) or "Traceback" in done.stderr:
            return f"{args[0]}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ''}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--cli-sample", type=int, default=100, help="cases also run through the CLI subprocess")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir, removed)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny tensors: one thread; a shared machine's spinning OpenMP pool costs 100x
    work = Path(tempfile.mkdtemp(prefix="fuzz-", dir=args.work))
    rng = random.Random(args.seed)
    counts: collections.Counter = collections.Counter()
    findings: dict[str, dict] = {}
    cli_every = max(1, args.cases // max(1, args.cli_sample)) if args.cli_sample else 0
    t0 = time.time()
    try:
        bases = make_bases(work)
        for case in range(args.cases):
            base = rng.choice(sorted(bases))
            d = work / "case"
            what = mutated(bases[base], d, rng)
            try:
                exercise(d)
                counts["opened_and_generated"] += 1
            except MoestreamError as e:
                counts["moestream_error"] += 1
                counts[f"error:{type(e).__name__}"] += 1
            except Exception as e:  # noqa: BLE001 - a finding
                counts["finding"] += 1
                key = where(e)
                findings.setdefault(key, {"count": 0, "example": f"case {case} {base} {what}: {e}"[:400]})
                findings[key]["count"] += 1
            if cli_every and case % cli_every == 0:
                counts["cli_runs"] += 1
                bad = run_cli(d)
                if bad is not None:
                    counts["cli_finding"] += 1
                    findings.setdefault(f"cli {bad[:80]}", {"count": 0, "example": f"case {case} {base} {what}"})
                    findings[f"cli {bad[:80]}"]["count"] += 1
            counts["cases_run"] += 1
            if (case + 1) % 100 == 0:
                print(f"{case + 1}/{args.cases} cases, {counts['finding']} findings, {time.time() - t0:.0f}s",
                      file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # Ctrl-C: report what ran
        counts["interrupted"] = 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"cases": args.cases, "seed": args.seed, "seconds": round(time.time() - t0, 1), "counts": dict(counts),
              "findings": findings}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
