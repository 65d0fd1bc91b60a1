"""`moestream demo`: build a small synthetic checkpoint once, then run it with a budget below its experts.

Owns the demo's defaults (family, preset, prompt, budget rule) and its narration. The checkpoint is cached under
the moestream cache directory, so only the first run pays for writing it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moestream.cli.common import add_budget_arg, open_engine, parse_budget
from moestream.cli.run import Sampling, encode_prompt, print_stats, stream_text
from moestream.config import format_bytes
from moestream.info import ModelInfo, model_info
from moestream.synth import default_cache_dir, synthesize
from moestream.tokenizer import Tokenizer

DEMO_FAMILY = "qwen3_moe"  # the one constant to change when a new family should headline the demo
DEMO_PRESET = "small"
DEMO_PROMPT = "Explain why a mixture-of-experts model can run on a machine with less memory than its weights."
# Random weights under greedy decoding fall into a loop that keeps hitting the same experts; sampling keeps the
# routing (and so the cache figures) realistic. Seeded, so every run of the demo prints the same thing.
DEMO_SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0, seed=0)
NOISE_NOTE = "this is a random-weight model: its text is noise; the stats are what matter"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a small synthetic model with experts paged under a tight budget",
                       description="Build (once) a small random-weight checkpoint and run it with a RAM budget "
                                   "that holds only a quarter of its experts.")
    add_budget_arg(p, "; default: dense weights + scratch + 1/4 of the expert bytes")
    p.add_argument("--dir", default=None, help="checkpoint directory to build/use (default: in the cache dir)")
    p.add_argument("--family", default=DEMO_FAMILY, help=f"family to synthesize (default {DEMO_FAMILY})")
    p.add_argument("--max-new", type=int, default=64, metavar="N", help="tokens to generate (64)")
    p.set_defaults(func=cmd_demo)


def demo_dir(family: str, override: str | None) -> Path:
    if override:
        return Path(override).expanduser()
    return default_cache_dir() / f"demo-{family.replace('-', '_')}-{DEMO_PRESET}"


def cmd_demo(args: argparse.Namespace) -> int:
    path = demo_dir(args.family, args.dir)
    if not (path / "config.json").is_file():
        print(f"building a synthetic {args.family} checkpoint ({DEMO_PRESET} preset) in {path} (first run only)",
              file=sys.stderr)
        synthesize(args.family, path, DEMO_PRESET)
    info = model_info(path)
    budget = parse_budget(args.ram_budget) or default_budget(info)
    _narrate(path, info, budget)
    engine = open_engine(path, budget)
    try:
        tok = Tokenizer.load(path)
        print(f"prompt:  {DEMO_PROMPT}\n")
        ids = encode_prompt(tok, DEMO_PROMPT, chat=True)
        report = stream_text(engine, tok, ids, Sampling(args.max_new, **DEMO_SAMPLING), sys.stdout)
        print()
        print_stats(report, sys.stdout)
    finally:
        engine.close()
    print(f"\nnote: {NOISE_NOTE}")
    return 0


def default_budget(info: ModelInfo) -> int:
    return info.dense_bytes + info.scratch_bytes + info.expert_bytes // 4


def _narrate(path: Path, info: ModelInfo, budget: int) -> None:
    print(f"model:   {path} ({info.model_type}, {info.total_params:,} parameters)")
    print(f"weights: {format_bytes(info.dense_bytes)} dense + {format_bytes(info.expert_bytes)} of experts")
    print(f"budget:  {format_bytes(budget)} in all, so most experts are read from disk when a token needs them")
    print(f"note:    {NOISE_NOTE}\n")
