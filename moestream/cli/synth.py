"""`moestream synth`: write a random-weight checkpoint in a family's real Hugging Face layout.

Owns the command-line surface only; layouts and writing live in moestream.synth.
"""
from __future__ import annotations

import argparse

from moestream.config import format_bytes
from moestream.synth import PRESETS, supported, synthesize


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write a random-weight checkpoint (for tests, demos, benchmarks)",
                       description="Write a random-weight checkpoint: config.json, tokenizer, sharded bf16 "
                                   "safetensors. Its text is noise; its sizes and I/O are real.")
    p.add_argument("family", metavar="FAMILY", help=f"one of {', '.join(supported())} (hyphens work too)")
    p.add_argument("dir", metavar="DIR", help="output directory (must not exist or be empty)")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny",
                   help="tiny (a few MB), small (a few hundred MB), medium (a few GB); default tiny")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--layers", type=int, metavar="N", help="override the preset's number of layers")
    p.add_argument("--vocab", type=int, metavar="N", help="override the preset's vocabulary size")
    p.set_defaults(func=cmd_synth)


def cmd_synth(args: argparse.Namespace) -> int:
    s = synthesize(args.family, args.dir, args.preset, args.seed, layers=args.layers, vocab=args.vocab)
    print(f"wrote {s['path']}: {s['model_type']} {s['preset']}, {s['params']:,} parameters, "
          f"{format_bytes(s['bytes'])} in {s['shards']} shards")
    return 0
