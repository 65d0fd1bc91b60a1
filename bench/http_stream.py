"""Issue #15 benchmark: decode a checkpoint streamed over HTTP against the link it comes through.

A hub-style server (tests/hfserver.py) runs in its own process on loopback, throttled to --bandwidth bytes/s (one
link shared by all connections) with --latency seconds added to every response. Three decodes of the same prompt
and seed under the same RAM budget, side by side:
  cold   hf://... with an empty SSD tier: decode tokens/s against the link bound (network bytes fetched per
         decoded token / bandwidth), requests in flight;
  warm   the same again with the SSD tier the cold run filled: network bytes (should be 0), tokens/s;
  local  the checkpoint directory itself: tokens/s (the warm run should be near it).
Run under `flock /work/bench.lock`. Prints one JSON object (and a short table on stderr).

    python bench/http_stream.py DIR [--bandwidth 200e6] [--latency 0.02] [--ram-budget 600MiB] [--gen 12]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def decode(path: Path, budget: str, prompt: list[int], gen: int, lookahead_reads: int | None, threads: int) -> dict:
    """One decode from a fresh engine: prefill, then `gen` tokens; network counters over the decode only."""
    from moestream.engine.engine import Engine

    eng = Engine.open(path, ram_budget=budget, threads=threads)
    if lookahead_reads is not None:
        eng.runner.lookahead.reads = lookahead_reads
    stats = getattr(eng.plan.store.index, "stats", lambda: {})
    try:
        t0, first, n = time.perf_counter(), None, 0
        at_first: dict = {}
        for _ in eng.stream(prompt, gen, temperature=1.0, seed=0, stop_token_ids=[]):
            n += 1
            if first is None:
                first, at_first = time.perf_counter(), stats()
        end, last = time.perf_counter(), stats()
    finally:
        eng.close()
    steps = max(1, n - 1)  # forward passes after the first token
    out = {"tokens": n, "ttft_s": first - t0, "decode_tok_s": steps / (end - first)}
    if last:
        net = last["http_bytes"] - at_first["http_bytes"]
        out.update(net_bytes_per_token=net / steps, requests_per_token=(last["http_requests"]
                   - at_first["http_requests"]) / steps, max_inflight=last["http_max_inflight"],
                   retries=last["http_retries"], total_http_bytes=last["http_bytes"],
                   disk_hit_bytes=last.get("disk_hit_bytes", 0), corrupt_ranges=last.get("disk_corrupt_ranges", 0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="a local checkpoint directory (served over HTTP)")
    ap.add_argument("--bandwidth", type=float, default=200e6, help="link bytes/s (default 200e6)")
    ap.add_argument("--latency", type=float, default=0.02, help="seconds added to each response (default 0.02)")
    ap.add_argument("--ram-budget", default="600MiB")
    ap.add_argument("--gen", type=int, default=12, help="tokens decoded per run")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--io-threads", type=int, default=8, help="range requests in flight (default 8)")
    ap.add_argument("--lookahead-reads", type=int, default=None, help="predicted experts read ahead per layer")
    ap.add_argument("--threads", type=int, default=1, help="compute threads (default 1: on a shared machine more "
                    "threads wait on each other's barriers, docs/performance.md)")
    ap.add_argument("--tmp", type=Path, default=None, help="where the SSD tier goes (default: the system's temp dir)")
    a = ap.parse_args()

    from moestream.weights import remote

    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "hfserver.py"), str(a.dir), "--repo",
                               "bench/model", "--bandwidth", str(a.bandwidth), "--latency", str(a.latency)],
                              stdout=subprocess.PIPE, text=True)
    try:
        os.environ["HF_ENDPOINT"] = server.stdout.readline().strip()
        with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
            remote.SETTINGS.disk_cache, remote.SETTINGS.io_threads = Path(tmp), a.io_threads
            prompt = [(i * 7919) % 1000 + 5 for i in range(a.prompt_len)]
            stub = remote.resolve("hf://bench/model")
            runs = {name: decode(p, a.ram_budget, prompt, a.gen, a.lookahead_reads, a.threads)
                    for name, p in (("cold", stub), ("warm", stub), ("local", a.dir))}
    finally:
        server.terminate()
        server.wait()
    cold = runs["cold"]
    link_s = cold["net_bytes_per_token"] / a.bandwidth
    report = {"bandwidth_bytes_per_s": a.bandwidth, "latency_s": a.latency, "ram_budget": a.ram_budget,
              "io_threads": a.io_threads, **{f"{k}_{n}": v for n, r in runs.items() for k, v in r.items()},
              "link_bound_s_per_token": link_s,
              "link_bound_fraction": link_s * cold["decode_tok_s"],
              # the slower of the link and this machine's own decode of the local checkpoint bounds a cold run
              "cold_vs_bound": cold["decode_tok_s"] / min(1 / link_s if link_s else float("inf"),
                                                         runs["local"]["decode_tok_s"]),
              "warm_vs_local": runs["warm"]["decode_tok_s"] / runs["local"]["decode_tok_s"]}
    print(json.dumps(report, indent=1))
    print(f"cold: {cold['decode_tok_s']:.2f} tok/s, {cold['net_bytes_per_token'] / 2**20:.1f} MiB fetched/token, "
          f"link bound {1 / link_s if link_s else float('inf'):.2f} tok/s -> {report['link_bound_fraction']:.2f} of it, "
          f"max {cold['max_inflight']} requests in flight; {report['cold_vs_bound']:.2f} of min(link, local)\n"
          f"warm: {runs['warm']['decode_tok_s']:.2f} tok/s, {runs['warm']['net_bytes_per_token']:.0f} B fetched/token; "
          f"local: {runs['local']['decode_tok_s']:.2f} tok/s (warm/local {report['warm_vs_local']:.2f})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
