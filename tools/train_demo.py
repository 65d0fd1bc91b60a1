#!/usr/bin/env python3
"""Reproduce the built-in demo model: `python tools/train_demo.py --out RUN_DIR` (same as `moestream train-demo`).

Resumable: rerun the same command after an interruption. See docs/demo-model.md for the recipe and its figures.
"""
import argparse
import sys

from moestream.errors import MoestreamError
from moestream.train import add_train_parser, run_train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="train_demo")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    args = parser.parse_args(["train-demo", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run_train(args)
    except MoestreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
