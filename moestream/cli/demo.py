"""`moestream demo`: run the built-in trained model (or a synthetic one) with a budget below its experts.

Owns the demo's defaults (which checkpoint, prompt, sampling, budget rule) and its narration. The default is
the small Kimi K3-architecture code-completion model shipped in `moestream/demo_model`; `--synthetic FAMILY`
builds (once, cached) a random-weight checkpoint of another family instead.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moestream import demo_model
from moestream.cli.common import add_budget_arg, add_state_room_arg, open_engine, parse_budget
from moestream.cli.run import Sampling, encode_prompt, print_stats, stream_text
from moestream.config import format_bytes
from moestream.info import ModelInfo, model_info
from moestream.synth import default_cache_dir, synthesize
from moestream.tokenizer import Tokenizer

SYNTH_PRESET = "small"
SYNTH_PROMPT = "Explain why a mixture-of-experts model can run on a machine with less memory than its weights."
# Seeded sampling: greedy decoding of a small model loops on one line, which also flatters the cache figures.
DEMO_SAMPLING = dict(temperature=0.7, top_p=0.95, top_k=0, seed=0)
NOISE_NOTE = "this is a random-weight model: its text is noise; the stats are what matter"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the built-in trained model with experts paged under a tight budget",
                       description="Run moestream's built-in demo model (a small Kimi K3-architecture Python "
                                   "code-completion model, MXFP4 experts) with a RAM budget that holds only a "
                                   "quarter of its experts, and print the cache and I/O figures.")
    add_budget_arg(p, "; default: dense weights + scratch + 1/4 of the expert bytes")
    add_state_room_arg(p)
    p.add_argument("--prompt", default=None, help=f"text to complete (default {demo_model.DEMO_PROMPT!r})")
    p.add_argument("--max-new", "--max-new-tokens", dest="max_new", type=int, default=96, metavar="N",
                   help="tokens to generate (96)")
    p.add_argument("--synthetic", default=None, metavar="FAMILY",
                   help="run a random-weight synthetic checkpoint of FAMILY instead (qwen3_moe, mixtral, ...)")
    p.add_argument("--dir", default=None, help="with --synthetic: checkpoint directory to build/use")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    synthetic = args.synthetic is not None
    path = _synthetic_dir(args.synthetic, args.dir) if synthetic else demo_model.path()
    info = model_info(path)
    budget = parse_budget(args.ram_budget) or default_budget(info)
    _narrate(path, info, budget, synthetic)
    prompt = args.prompt or (SYNTH_PROMPT if synthetic else demo_model.DEMO_PROMPT)
    engine = open_engine(path, budget, args.state_room, args.kv_dtype)
    try:
        tok = Tokenizer.load(path)
        print(f"prompt:\n{prompt}", end="" if prompt.endswith("\n") else "\n")
        ids = encode_prompt(tok, prompt, chat=synthetic)
        report = stream_text(engine, tok, ids, Sampling(args.max_new, **DEMO_SAMPLING), sys.stdout)
        print()
        print_stats(report, sys.stdout)
    finally:
        engine.close()
    print(f"cold-cache minimum (moestream info): {format_bytes(info.expert_bytes_per_token_cold)} "
          f"({info.expert_bytes_per_token_cold} bytes) of experts per token")
    if synthetic:
        print(f"\nnote: {NOISE_NOTE}")
    return 0


def _synthetic_dir(family: str, override: str | None) -> Path:
    path = Path(override).expanduser() if override else \
        default_cache_dir() / f"demo-{family.replace('-', '_')}-{SYNTH_PRESET}"
    if not (path / "config.json").is_file():
        print(f"building a synthetic {family} checkpoint ({SYNTH_PRESET} preset) in {path} (first run only)",
              file=sys.stderr)
        synthesize(family, path, SYNTH_PRESET)
    return path


def default_budget(info: ModelInfo) -> int:
    return info.dense_bytes + info.scratch_bytes + info.expert_bytes // 4


def _narrate(path: Path, info: ModelInfo, budget: int, synthetic: bool) -> None:
    what = "random-weight synthetic model" if synthetic else \
        "moestream's demo model: Kimi K3 architecture, trained here on Python's standard library"
    print(f"model:   {what}\n         {path}")
    print(f"         {info.model_type}, {info.num_layers} layers, {info.num_experts} experts per MoE layer, "
          f"top-{info.top_k}, {info.total_params:,} parameters")
    print(f"weights: {format_bytes(info.dense_bytes)} dense + {format_bytes(info.expert_bytes)} of experts")
    print(f"budget:  {format_bytes(budget)} in all, so most experts are read from disk when a token needs them\n")
