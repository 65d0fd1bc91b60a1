"""Helpers shared by the subcommands: the --ram-budget option and its default (no limit where the model fits in
the memory available, a share of that memory where it does not), opening a model with a progress bar, paths.

Owns how the CLI turns user strings into typed values (through moestream.config) and how it shows that a
long open is still working. It does no model work of its own.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from moestream.config import COMPUTE_DTYPE_NAMES, DEFAULT_BUDGET_SHARE, KV_DTYPE_NAMES, format_bytes, parse_bytes
from moestream.errors import MoestreamError

PROGRESS_DELAY_S = 1.0  # show a bar only for work that takes longer than this


def add_budget_arg(p: argparse.ArgumentParser, help_extra: str = "") -> None:
    p.add_argument("--ram-budget", metavar="BYTES", default=None,
                   help="RAM for everything the engine keeps resident: dense weights, KV cache, expert cache "
                        "(e.g. 4GiB, 512MiB, 2GB)" + help_extra)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_threads_arg(p: argparse.ArgumentParser, help_extra: str = "") -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads for the forward pass (default: all cores)" + help_extra)


def add_state_room_arg(p: argparse.ArgumentParser) -> None:
    """The sequence-state options: --state-room and --kv-dtype."""
    p.add_argument("--state-room", metavar="BYTES", default=None,
                   help="part of --ram-budget the residency plan keeps free for KV caches and recurrent state "
                        "when dense weights must stream (default: none reserved; state then takes room from "
                        "the expert cache and a too-long context fails with a budget error). The batch job and "
                        "the server keep a streamed lm_head's leading rows resident only when it is given (they "
                        "would take the cache's room that their sequences' state grows into)")
    p.add_argument("--kv-dtype", choices=sorted(KV_DTYPE_NAMES), default="fp32",
                   help="storage of KV and latent caches: fp32 (default; the parity bounds are fp32's), bf16 "
                        "(half the bytes), int8 (groups of 64 values with an fp32 scale: 0.27 of fp32's "
                        "bytes, about twice bf16's sequences) or int4 (the same groups, two values a byte: 0.14 of "
                        "fp32's bytes, about twice int8's sequences, a larger loss: docs/memory.md); attention "
                        "still computes in fp32")


def add_compute_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--compute-dtype (EngineOptions.compute_dtype), shared by run, serve, batch and bench."""
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPE_NAMES, default="fp32",
                   help="precision of products over many rows (prefill chunks, batch steps of 16+ rows): fp32 "
                        "(default; the parity bounds are fp32's) or bf16 (bf16 weights times activations rounded "
                        "to bf16, fp32 sums: faster on CPUs with AVX-512 BF16, logits about bf16's rounding off "
                        "fp32's; MXFP4 experts (Kimi K3, gpt-oss) round their activations in one-token decode too; "
                        "other one-token products and the routers stay fp32)")


def parse_budget(value: str | None) -> int | None:
    budget = parse_bytes(value)
    if budget is not None and budget <= 0:
        raise MoestreamError(f"--ram-budget must be positive, got {value!r}")
    return budget


DEFAULT_BUDGET_HELP = (f"; default: none where every weight fits in {DEFAULT_BUDGET_SHARE * 100:.0f}%% of the memory "
                       "available, else that much")


def resolve_budget(value: str | None, path: Path, state_room: str | None = None) -> int | None:
    """--ram-budget, or with none given a budget that cannot exhaust the machine: no limit when every weight fits
    in DEFAULT_BUDGET_SHARE of the memory this process can take (cgroup.memory_available), else that share, said
    on stderr (without a limit the expert cache would grow until the kernel killed the process). A --state-room
    left with no budget to be part of is said too: it does nothing then."""
    budget = parse_budget(value)
    if budget is None:
        budget = _default_budget(path)
    if budget is None and state_room is not None:
        print(f"note: --state-room {state_room} does nothing without a budget (the model runs with no limit); "
              "pass --ram-budget for it to apply", file=sys.stderr)
    return budget


def _default_budget(path: Path) -> int | None:
    """resolve_budget's answer with no --ram-budget: None (no limit) or the share, or an error where the share is
    below the model's minimum."""
    from moestream.cgroup import memory_available
    from moestream.info import model_info

    room = memory_available()
    if room is None:
        return None
    info = model_info(path)
    share = int(DEFAULT_BUDGET_SHARE * room)
    if info.all_resident_budget + info.expert_bytes <= share:
        return None
    if share < info.min_ram_budget:
        raise MoestreamError(f"no --ram-budget: {path.name} needs at least {format_bytes(info.min_ram_budget)} "
                             f"({info.min_ram_budget} bytes, every dense layer streamed) and "
                             f"{DEFAULT_BUDGET_SHARE:.0%} of the {format_bytes(room)} available is "
                             f"{format_bytes(share)}; free memory or pass --ram-budget")
    print(f"note: no --ram-budget: {path.name} ({format_bytes(info.total_bytes)}) does not fit in "
          f"{format_bytes(room)} of available memory; using {format_bytes(share)} ({DEFAULT_BUDGET_SHARE:.0%} of "
          "it) as the budget (pass --ram-budget to choose)", file=sys.stderr)
    return share


def add_remote_args(p: argparse.ArgumentParser) -> None:
    """--disk-cache / --disk-budget / --offline: the SSD tier of a remote (hf:// or http(s)://) checkpoint."""
    g = p.add_argument_group("remote checkpoints (hf://ORG/NAME[@REV], https://.../DIR/)")
    g.add_argument("--disk-cache", metavar="DIR", default=None,
                   help="keep fetched byte ranges on local disk here (default: $MOESTREAM_DISK_CACHE; without one "
                        "only config, tokenizer and headers are kept)")
    g.add_argument("--disk-budget", metavar="BYTES", default=None,
                   help="most bytes of ranges the disk cache holds; least recently used ranges are evicted "
                        "(default: $MOESTREAM_DISK_BUDGET, else no limit)")
    g.add_argument("--offline", action="store_true", default=None,
                   help="never touch the network: everything must already be in the disk cache")


def configure_remote(args: argparse.Namespace) -> None:
    """Apply a subcommand's remote options to the process's remote settings (flags override the environment)."""
    if not hasattr(args, "disk_cache"):
        return
    from moestream.weights.remote import SETTINGS

    if args.disk_cache is not None:
        SETTINGS.disk_cache = Path(args.disk_cache).expanduser()
    if args.disk_budget is not None:
        SETTINGS.disk_budget = parse_bytes(args.disk_budget)
        if SETTINGS.disk_budget is not None and SETTINGS.disk_budget <= 0:
            raise MoestreamError(f"--disk-budget must be positive, got {args.disk_budget!r}")
    if args.offline:
        SETTINGS.offline = True


def model_dir(value: str, full: bool = True) -> Path:
    """A local checkpoint directory; a remote spec (hf://, http(s)://) becomes its local stub (weights/remote.py's
    `model_path`, which Engine.open uses too), with the tokenizer and other run-time files unless `full` is False
    (headers only, for `info` and `plan`)."""
    from moestream.weights.remote import is_remote, model_path

    if is_remote(value):
        with busy(f"contacting {value}"):
            stub = model_path(value, full=full)
        if full:  # `info` prints the pinned revision itself
            _report_revision(value, stub)
        return stub
    path = model_path(value)
    if not path.is_dir():
        raise MoestreamError(f"{value}: no such model directory (pass a local checkpoint directory, hf://ORG/NAME "
                             f"or https://.../DIR/)")
    return path


def _report_revision(spec: str, stub: Path) -> None:
    from moestream.weights.remote import manifest_of

    rev = (manifest_of(stub) or {}).get("revision")
    print(f"{spec}: revision {rev}" if rev else f"{spec}: pinned by ETag", file=sys.stderr)


@contextmanager
def busy(desc: str) -> Iterator[None]:
    """An elapsed-time bar on stderr for work with no natural progress count; silent if it ends within ~1 s."""
    bar = tqdm(total=None, desc=desc, file=sys.stderr, delay=PROGRESS_DELAY_S, leave=False,
               bar_format="{desc}: {elapsed}")
    done, start = threading.Event(), time.monotonic()

    def tick() -> None:
        while not done.wait(0.25):
            if time.monotonic() - start >= PROGRESS_DELAY_S:  # refresh() would draw at once, ignoring delay
                bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


def open_engine(path: Path, budget: int | None, state_room: str | None = None, kv_dtype: str = "fp32",
                compute_dtype: str = "fp32", threads: int | None = None):
    from moestream.engine.engine import Engine

    with busy(f"opening {path.name}"):  # a remote model: its dense weights are fetched here
        return Engine.open(path, ram_budget=budget, state_room=state_room, kv_dtype=kv_dtype,
                           compute_dtype=compute_dtype, threads=threads)


def now() -> float:
    return time.perf_counter()
