"""`moestream fetch MODEL --disk-cache DIR [--hot N]`: fill the SSD tier of a remote checkpoint ahead of a run.

Owns the pre-fetch plan (whole shards in fixed chunks, or the dense weights plus the N hottest experts of each
MoE layer by recorded heat, as the same ranges the reader asks for), the space check that refuses a fetch the
disk or the budget cannot hold, and the progress bar. Resuming is free: chunks already on disk are skipped, so
an interrupted fetch re-fetches at most the chunks that were in flight.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from moestream.cli.common import add_remote_args, model_dir
from moestream.config import format_bytes
from moestream.errors import MoestreamError

CHUNK = 16 << 20  # whole-file fetches go in ranges of this size: the unit of resumption


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch", help="pre-fetch a remote checkpoint (hf://, https://) into the disk cache",
                       description="Download a remote checkpoint's shards (or its dense weights and hottest "
                                   "experts) into --disk-cache, resuming where an earlier fetch stopped.")
    p.add_argument("model", help="hf://ORG/NAME[@REV] or https://.../DIR/")
    p.add_argument("--hot", type=int, default=None, metavar="N",
                   help="only the dense weights and the N hottest experts of each MoE layer by recorded heat "
                        "(`moestream bench MODEL --policy heat` records it)")
    add_remote_args(p)
    p.set_defaults(func=cmd_fetch)


def cmd_fetch(args: argparse.Namespace) -> int:
    from moestream.weights.remote import SETTINGS, is_remote, open_remote_index

    if not is_remote(args.model):
        raise MoestreamError(f"{args.model}: fetch takes a remote checkpoint (hf://ORG/NAME or https://.../DIR/)")
    if SETTINGS.disk_cache is None:
        raise MoestreamError("fetch needs --disk-cache DIR (or $MOESTREAM_DISK_CACHE): where the bytes go")
    stub = model_dir(args.model)
    index = open_remote_index(stub)
    ranges = hot_ranges(stub, args.hot) if args.hot is not None else whole_file_ranges(index)
    todo = [(f, off, n) for f, off, n in ranges if not index.cache.covered(f.key, off, n)]
    need, total = sum(n for *_, n in todo), sum(n for *_, n in ranges)
    check_space(index.cache.root, need, total, SETTINGS.disk_budget)
    rev = index.manifest.get("revision")
    print(f"{args.model}{f' (revision {rev})' if rev else ''}: {format_bytes(total)} in {len(ranges)} ranges, "
          f"{format_bytes(total - need)} already cached", file=sys.stderr)
    with tqdm(total=need, unit="B", unit_scale=True, unit_divisor=1024, desc="fetch", file=sys.stderr) as bar:
        def one(item) -> None:
            f, off, n = item
            buf = memoryview(bytearray(n))
            f.fetch(off, buf)
            bar.update(n)

        with ThreadPoolExecutor(SETTINGS.io_threads) as ex:
            list(ex.map(one, todo))
    s = index.stats()
    print(f"fetched {format_bytes(s['http_bytes'])} in {s['http_requests']} requests "
          f"({s['http_retries']} retries); disk cache {format_bytes(index.cache.usage())} at {index.cache.root}",
          file=sys.stderr)
    return 0


def whole_file_ranges(index) -> list[tuple[object, int, int]]:
    files = {info.file for info in index.tensors.values()}
    out = []
    for f in sorted(files, key=lambda f: f.name):
        for off in range(0, f.size, CHUNK):
            out.append((f, off, min(CHUNK, f.size - off)))
    return out


def hot_ranges(stub: Path, n: int) -> list[tuple[object, int, int]]:
    """Dense tensors whole, and the read runs of the `n` hottest experts per MoE layer (the reader's ranges)."""
    from moestream.engine.engine import plan
    from moestream.experts.policies import heat_path

    if n < 0:
        raise MoestreamError(f"--hot must be at least 0, got {n}")
    path = heat_path(stub)
    try:
        rows = json.loads(path.read_text())["heat"]
    except (OSError, ValueError, KeyError, TypeError):
        raise MoestreamError(f"no recorded expert heat for this model ({path}); record it with `moestream bench "
                             f"MODEL --policy heat`, or fetch whole files without --hot") from None
    p = plan(stub)
    out = [(p.store.index[name].file, p.store.index[name].offset, p.store.index[name].nbytes)
           for name in p.dense_names]
    by_layer: dict[int, list[tuple[float, int]]] = {}
    for layer, expert, heat in rows:
        by_layer.setdefault(int(layer), []).append((float(heat), int(expert)))
    for layer, rows_ in by_layer.items():
        for _, expert in sorted(rows_, reverse=True)[:n]:
            rp, _ = p.store.read_plan(layer, expert)
            out.extend((r.file, r.start, min(r.length, r.file.size - r.start)) for r in rp.runs)
    p.store.close()
    return out


def check_space(root: Path, need: int, total: int, budget: int | None) -> None:
    free = shutil.disk_usage(root).free
    overhead = need // 256 + (1 << 20)  # range headers and block checksums
    if need + overhead > free:
        raise MoestreamError(f"not enough disk space at {root}: the fetch needs {format_bytes(need + overhead)} more, "
                             f"{format_bytes(free)} free")
    if budget is not None and total > budget:
        raise MoestreamError(f"the fetch holds {format_bytes(total)}, more than --disk-budget {format_bytes(budget)}: "
                             f"raise the budget or fetch less (--hot N)")
