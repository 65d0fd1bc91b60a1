"""`moestream pack MODEL DST [--verify]` and `moestream pack --verify DST`: the command-line surface of
moestream.pack (progress bar, summary line). The layout and checks live there; see docs/pack.md.
"""
from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from moestream.cli.common import PROGRESS_DELAY_S, model_dir
from moestream.config import format_bytes
from moestream.errors import MoestreamError


def add_pack_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "pack", help="re-lay a checkpoint so each expert is one aligned, checksummed read (optional)",
        description="Write a copy of MODEL in which every routed expert is one contiguous, 4 KiB-aligned range "
                    "with a crc32 (one read per expert, checked on every read). Dense tensors stay in safetensors "
                    "shards; config, tokenizer and other files are copied. Running MODEL as it is stays supported. "
                    "With only DST and --verify, re-read an existing packed directory and check every checksum.")
    p.add_argument("model", metavar="MODEL", help="checkpoint directory to pack (read only)")
    p.add_argument("dst", metavar="DST", nargs="?", help="new directory to write (must not exist)")
    p.add_argument("--verify", action="store_true",
                   help="after packing, re-read DST from disk and check every checksum (alone: verify MODEL)")
    p.add_argument("--codec", choices=["b12"], default=None,
                   help="store bf16 expert matrices, the untied lm_head, dense / shared-expert MLPs and GQA "
                        "attention projections in the lossless 12-bit coding b12 where it saves a tenth of their "
                        "bytes (the same values, about 25%% fewer bytes to read and to cache; docs/pack.md). "
                        "Default: as stored")
    p.set_defaults(func=cmd_pack)
    return p


def _with_bar(desc: str, work):
    """work(progress=..., total=...) under a byte progress bar on stderr (shown only after PROGRESS_DELAY_S)."""
    bar = tqdm(total=0, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
               delay=PROGRESS_DELAY_S, leave=False)

    def total(n: int) -> None:
        bar.total = n  # no refresh: the bar stays hidden for work done within its delay

    try:
        return work(progress=bar.update, total=total)
    finally:
        bar.close()


def cmd_pack(args: argparse.Namespace) -> int:
    from moestream.pack import pack, verify_pack

    if args.dst is None:
        if not args.verify:
            raise MoestreamError("pack needs MODEL and DST (or --verify DST to check a packed directory)")
        path = model_dir(args.model)
        n = _with_bar(f"verifying {path.name}", lambda **kw: verify_pack(path, **kw))
        print(f"{path}: all {n} checksums match")
        return 0
    src = model_dir(args.model)
    s = _with_bar(f"packing {src.name}", lambda **kw: pack(src, args.dst, verify=False, codec=args.codec, **kw))
    coded = f" (coded b12: {format_bytes(s.coded_bytes)})" if s.coded_bytes else ""
    dense = (f" (of which {format_bytes(s.dense_coded_source)} coded b12: {format_bytes(s.dense_coded_bytes)})"
             if s.dense_coded_bytes else "")
    print(f"wrote {s.path}: {s.experts} experts in {s.expert_files} file(s), {format_bytes(s.expert_bytes)} of "
          f"experts{coded} + {format_bytes(s.dense_bytes)} dense{dense} in {s.dense_files} shard(s), "
          f"{format_bytes(s.disk_bytes)} on disk")
    if args.verify:
        n = _with_bar("verifying", lambda **kw: verify_pack(s.path, **kw))
        print(f"verified: all {n} checksums match")
    return 0
