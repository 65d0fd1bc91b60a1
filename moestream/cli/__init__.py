"""The `moestream` command: one argparse parser with a subcommand per front-end task.

Owns the parser, dispatch and the error contract: a MoestreamError prints `error: <message>` on stderr and exits
with code 2 (no traceback); Ctrl-C exits quietly with 130. Each subcommand lives in its own module and exposes
`add_parser(subparsers)`, which registers the handler as the parser's `func` default.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from moestream import __version__
from moestream.errors import MoestreamError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130

# Subcommands that live beside the feature they drive: (module, function registering the subparser).
EXTRA_COMMANDS: list[tuple[str, str]] = [
    ("moestream.bench", "add_bench_parser"),
    ("moestream.trace", "add_trace_parser"),
    ("moestream.server", "add_serve_parser"),
    ("moestream.train", "add_train_parser"),
    ("moestream.cli.pack", "add_pack_parser"),
]


def build_parser() -> argparse.ArgumentParser:
    from moestream.cli import batch, demo, fetch, info, plan, run, synth

    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run Mixture-of-Experts checkpoints larger than RAM: routed experts are paged from the "
                    "safetensors shards into a byte-budgeted cache.")
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (run, batch, info, plan, synth, demo, fetch):
        module.add_parser(sub)
    for module_name, function in EXTRA_COMMANDS:
        _add_extra(sub, module_name, function)
    return parser


def _add_extra(sub: argparse._SubParsersAction, module_name: str, function: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:  # a real missing dependency inside the module: let it show
            raise
        return  # that feature is not part of this install
    getattr(module, function)(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from moestream.cli.common import configure_remote

        configure_remote(args)
        return int(args.func(args) or 0)
    except MoestreamError as e:
        _flush_quietly()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        _flush_quietly()
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `moestream run ... | head`: the reader left; nothing more to say
        # Point stdout at /dev/null so the interpreter's final flush does not complain a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _flush_quietly() -> None:
    """Push out text already streamed, so it lands before the error message rather than after it."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
