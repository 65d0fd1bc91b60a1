"""`moestream synth`: write a random-weight checkpoint in a family's real Hugging Face layout.

Owns the command-line surface only; layouts and writing live in moestream.synth.
"""
from __future__ import annotations

import argparse

from moestream.config import format_bytes
from moestream.synth import PRESETS, supported, synthesize

# Disk per layer at the published widths (tests/test_synth.py checks these against synth.full_width_sizes);
# embeddings + lm_head at the published vocabulary / at --vocab 32768.
FULL_WIDTH_SIZES = """\
full-width disk sizes (every tensor at the published shape and dtype; only --layers and --vocab reduced):
  kimi_k3      dense layer 1.79 GiB (MLA mixer; 2.18 GiB with KDA), MoE layer (896 MXFP4 experts) 15.43 GiB
               (15.82 GiB with KDA), embeddings + lm_head 4.39 GiB (0.89 GiB at --vocab 32768);
               --layers 2 (one dense + one MoE layer, both MLA): 21.60 GiB, 18.10 GiB at --vocab 32768
  deepseek_v3  dense layer 0.54 GiB, MoE layer (256 block-FP8 experts) 10.72 GiB, embeddings + lm_head
               3.45 GiB (0.88 GiB at --vocab 32768); --layers 2: 14.72 GiB, 12.14 GiB at --vocab 32768
  kimi_k2      dense layer 0.93 GiB (bf16), MoE layer (384 int4 experts, bf16 attention and shared expert)
               9.13 GiB, embeddings + lm_head 4.38 GiB (0.88 GiB at --vocab 32768); --layers 2: 14.44 GiB,
               10.94 GiB at --vocab 32768
  gpt_oss      layer (attention + 128 MXFP4 experts; every layer is MoE) 1.63 GiB, embeddings + lm_head 2.16 GiB
               (0.35 GiB at --vocab 32768); --layers 2: 5.41 GiB, 3.61 GiB at --vocab 32768
Writing streams one bounded chunk at a time (peak RSS well under 1 GiB whatever the size)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synth", help="write a random-weight checkpoint (for tests, demos, benchmarks)",
                       description="Write a random-weight checkpoint: config.json, tokenizer, sharded "
                                   "safetensors. Its text is noise; its sizes and I/O are real.",
                       epilog=FULL_WIDTH_SIZES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", metavar="FAMILY", help=f"one of {', '.join(supported())} (hyphens work too)")
    p.add_argument("dir", metavar="DIR", help="output directory (must not exist or be empty)")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny",
                   help="tiny (a few MB), small (a few hundred MB), medium (a few GB), full-width (the published "
                        "model's widths, kimi_k3 / deepseek_v3 / kimi_k2 / gpt_oss only, needs --layers; sizes "
                        "below); default tiny")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--layers", type=int, metavar="N", help="override the preset's number of layers")
    p.add_argument("--vocab", type=int, metavar="N", help="override the preset's vocabulary size (full-width: keeps "
                                                          "embeddings and lm_head small)")
    p.set_defaults(func=cmd_synth)


def cmd_synth(args: argparse.Namespace) -> int:
    s = synthesize(args.family, args.dir, args.preset, args.seed, layers=args.layers, vocab=args.vocab)
    print(f"wrote {s['path']}: {s['model_type']} {s['preset']}, {s['params']:,} parameters, "
          f"{format_bytes(s['bytes'])} in {s['shards']} shards")
    return 0
