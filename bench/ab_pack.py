"""A/B of a checkpoint against its packed copy (`moestream pack`): cold `moestream bench` runs, alternated in one
process so a noisy machine hits every variant alike.

Variants: each MODEL given (originals and packed copies), packed ones also with MOESTREAM_VERIFY=0 (crc32 off)
unless --no-crc-off. One discarded warm-up run first (one-time costs: imports, native kernel build). Per run:
decode tok/s, expert bytes and read requests per decoded token,
preadv calls, io_roofline_fraction, and the time spent in crc32 (in the I/O threads, overlapping other work).
    python bench/ab_pack.py MODEL [MODEL ...] [--ram-budget 1GiB] [--rounds 2] [--gen-len 32] [--prompt-len 32]
"""
import argparse
import json
import os
import statistics
from pathlib import Path

from moestream import bench as mb
from moestream.config import parse_bytes
from moestream.weights.index import PACK_MANIFEST

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("models", nargs="+")
parser.add_argument("--no-crc-off", action="store_true", help="skip the packed runs with the checksum off")
parser.add_argument("--ram-budget", default="1GiB")
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--gen-len", type=int, default=32)
parser.add_argument("--prompt-len", type=int, default=32)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--json", default=None, help="write every run's figures here")
args = parser.parse_args()

snaps = []
real_snapshot = mb._snapshot


def snapshot(eng, clock):
    """bench's own snapshot (taken after prefill and after decode), plus the reader's and checksum counters."""
    io, store = eng.plan.store.reader.stats, eng.plan.store
    snaps.append((io.requests, io.preads, store.checksum_s, store.checksum_bytes))
    return real_snapshot(eng, clock)


mb._snapshot = snapshot
VARIANTS = []
for m in args.models:
    VARIANTS.append((Path(m).name, m, "1"))
    if (Path(m) / PACK_MANIFEST).exists() and not args.no_crc_off:
        VARIANTS.append((Path(m).name + " (no crc)", m, "0"))
runs = []
for r in range(-1, args.rounds):
    for name, path, verify in (VARIANTS[:1] if r < 0 else VARIANTS):
        os.environ["MOESTREAM_VERIFY"] = verify
        snaps.clear()
        opts = mb.BenchOptions(ram_budget=parse_bytes(args.ram_budget), prompt_len=args.prompt_len,
                               gen_len=args.gen_len, cold=True, temperature=args.temperature, seed=r)
        rep = mb.bench(path, opts)
        (q0, p0, c0, b0), (q1, p1, c1, b1) = snaps[0], snaps[-1]
        n = args.gen_len
        row = {"variant": name, "round": r, "decode_tok_s": rep["decode_tokens_per_s"],
               "bytes_read_per_token": rep["bytes_read_per_token"], "reads_per_token": (q1 - q0) / n,
               "preads_per_token": (p1 - p0) / n, "io_roofline_fraction": rep["io_roofline_fraction"],
               "hit_rate": rep["expert_hit_rate"], "disk_bw": rep["disk_bandwidth_bytes_per_s"],
               "read_bw": rep["read_bandwidth_bytes_per_s"], "crc_s_per_token": (c1 - c0) / n,
               "crc_gb_s": (b1 - b0) / (c1 - c0) / 1e9 if c1 > c0 else None,
               "decode_s_per_token": 1 / rep["decode_tokens_per_s"], "io_wait_s": rep["decode_phases_s"]["io_wait_s"]}
        if r < 0:
            continue  # warm-up
        runs.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

print("\nmedians over rounds:")
keys = ["decode_tok_s", "bytes_read_per_token", "reads_per_token", "preads_per_token", "io_roofline_fraction",
        "hit_rate", "crc_s_per_token", "decode_s_per_token"]
for name, _, _ in VARIANTS:
    rows = [x for x in runs if x["variant"] == name]
    med = {k: statistics.median(x[k] for x in rows if x[k] is not None) for k in keys
           if any(x[k] is not None for x in rows)}
    print(f"{name:28s} " + "  ".join(f"{k}={v:.4g}" for k, v in med.items()))
if args.json:
    with open(args.json, "w") as fh:
        json.dump(runs, fh, indent=1)
