"""Load test for `moestream serve`: N concurrent streaming clients versus one, against a running server.

Reports aggregate tokens/s, decode tokens/s, time to first token and inter-token latency (p50/p99) for a single
client and for N concurrent clients, their ratio, and the server's expert hit rate and bytes read per phase.

    python bench/serve_load.py --url http://127.0.0.1:8000 --clients 8 --max-tokens 64
    python bench/serve_load.py --serve MODEL_DIR --expert-fraction 0.25 --clients 8   # starts its own server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

SERVE = ("import argparse, sys; from moestream.server import add_serve_parser, run_serve; "
         "p = argparse.ArgumentParser(); add_serve_parser(p.add_subparsers()); sys.exit(run_serve(p.parse_args()))")


@dataclass
class Stream:
    start: float = 0.0
    times: list[float] = field(default_factory=list)  # arrival of each content chunk
    tokens: int = 0  # completion tokens from the usage chunk


async def one_stream(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    s = Stream(start=time.perf_counter())
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"server answered {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"stream failed: {chunk['error']}")
            if chunk.get("usage"):
                s.tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                s.times.append(time.perf_counter())
    return s


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


async def metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await http.get(url + "/metrics")).text
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


async def phase(http, url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    before = await metrics(http, url)
    t0 = time.perf_counter()
    streams = await asyncio.gather(*(one_stream(http, url, model, p, max_tokens) for p in prompts))
    wall = time.perf_counter() - t0
    after = await metrics(http, url)
    firsts = [s.times[0] for s in streams if s.times]
    lasts = [s.times[-1] for s in streams if s.times]
    decode_tokens = sum(max(0, s.tokens - 1) for s in streams)
    decode_span = max(lasts) - min(firsts) if firsts else float("nan")
    # steady state: text chunks that arrive while every stream is decoding (after the last first token, up to the
    # first last token). Not skewed by a late-arriving request's prefill, which TTFT reports.
    start, end = (max(firsts), min(lasts)) if firsts else (0.0, 0.0)
    steady = sum(1 for s in streams for t in s.times if start < t <= end)
    itl = [b - a for s in streams for a, b in zip(s.times, s.times[1:])]
    d = {k: after[k] - before[k] for k in after if k.endswith("_total")}
    return {"clients": len(prompts), "tokens": sum(s.tokens for s in streams), "wall_s": wall,
            "tokens_per_s": sum(s.tokens for s in streams) / wall,
            "decode_tokens_per_s": decode_tokens / decode_span if decode_span > 0 else float("nan"),
            "steady_decode_tokens_per_s": steady / (end - start) if end > start else float("nan"),
            "ttft_p50_s": pct([s.times[0] - s.start for s in streams if s.times], 50),
            "ttft_p99_s": pct([s.times[0] - s.start for s in streams if s.times], 99),
            "itl_p50_ms": 1000 * pct(itl, 50), "itl_p99_ms": 1000 * pct(itl, 99),
            "engine_steps": d.get("moestream_engine_steps_total", 0),
            "experts_per_step": (d.get("moestream_expert_hits_total", 0) + d.get("moestream_expert_misses_total", 0))
            / max(1, d.get("moestream_engine_steps_total", 0)),
            "phase_hit_rate": d.get("moestream_expert_hits_total", 0) / max(1, d.get("moestream_expert_hits_total", 0)
                                                                          + d.get("moestream_expert_misses_total", 0)),
            "expert_bytes_read": d.get("moestream_expert_bytes_read_total", 0)}


def print_phase(name: str, r: dict) -> None:
    print(f"{name:>10}: {r['clients']} client(s), {r['tokens']} tokens in {r['wall_s']:.2f} s | aggregate "
          f"{r['tokens_per_s']:.2f} tok/s, decode {r['decode_tokens_per_s']:.2f} tok/s, steady "
          f"{r['steady_decode_tokens_per_s']:.2f} tok/s | TTFT p50 "
          f"{r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s | ITL p50 {r['itl_p50_ms']:.1f} ms p99 "
          f"{r['itl_p99_ms']:.1f} ms | steps {r['engine_steps']:.0f}, experts fetched per step "
          f"{r['experts_per_step']:.1f}, hit rate {r['phase_hit_rate']:.3f}, expert bytes read "
          f"{r['expert_bytes_read'] / 2**20:.1f} MiB")


async def run(args, url: str) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=httpx.Limits(max_connections=64)) as http:
        model = args.model or (await http.get(url + "/v1/models")).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        vocab = args.vocab
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.clients + 1)]
        await phase(http, url, model, prompts, args.warmup_tokens)  # fill the expert cache, warm up torch
        rounds = []
        for _ in range(args.repeats):  # alternate, so drifting machine load hits both sides alike
            single = await phase(http, url, model, prompts[:1], args.max_tokens)
            many = await phase(http, url, model, prompts[1:], args.max_tokens)
            print_phase("single", single)
            print_phase("concurrent", many)
            rounds.append({"single": single, "concurrent": many,
                           "decode_ratio": many["decode_tokens_per_s"] / single["decode_tokens_per_s"],
                           "steady_ratio": many["steady_decode_tokens_per_s"] / single["steady_decode_tokens_per_s"],
                           "aggregate_ratio": many["tokens_per_s"] / single["tokens_per_s"]})
    medians = {}
    for key, what in (("decode_ratio", "decode tokens/s (first to last token of any stream)"),
                      ("steady_ratio", "steady decode tokens/s (while all streams decode)")):
        ratios = [r[key] for r in rounds]
        medians[key] = sorted(ratios)[len(ratios) // 2]
        print(f"{args.clients} concurrent vs 1: {what} ratio per round "
              f"{', '.join(f'{r:.2f}x' for r in ratios)}; median {medians[key]:.2f}x")
    return {"rounds": rounds, "median_decode_ratio": medians["decode_ratio"],
            "median_steady_ratio": medians["steady_ratio"]}


def budget_for(model: str, fraction: float, state_room: str) -> int:
    from moestream.config import parse_bytes
    from moestream.engine.engine import plan

    p = plan(model)
    return p.dense_bytes + p.scratch_bytes + max(p.max_expert_bytes, int(p.expert_bytes * fraction)) + \
        parse_bytes(state_room)


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", SERVE, "serve", args.serve, "--port", str(port), "--max-batch", str(args.clients),
           "--prefix-cache", "0"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.expert_fraction is not None:
        budget = budget_for(args.serve, args.expert_fraction, args.state_room)
        cmd += ["--ram-budget", str(budget)]
        print(f"--ram-budget {budget} bytes: dense + scratch + {args.expert_fraction:g} of the experts + "
              f"{args.state_room} for sequence state")
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not come up within 300 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--serve", metavar="MODEL", help="start a server on MODEL instead (prefix reuse off)")
    ap.add_argument("--expert-fraction", type=float, help="with --serve: budget holding this fraction of the experts")
    ap.add_argument("--state-room", default="64MiB", help="with --expert-fraction: budget room for KV caches")
    ap.add_argument("--threads", type=int, help="with --serve: the server's --threads")
    ap.add_argument("--api-key")
    ap.add_argument("--model", help="model id (default: the server's first)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--warmup-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of (single, concurrent); the median ratio is reported")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn from [0, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if bool(args.url) == bool(args.serve):
        ap.error("give exactly one of --url and --serve")
    proc = None
    url = args.url.rstrip("/") if args.url else None
    if args.serve:
        proc, url = start_server(args)
    try:
        result = asyncio.run(run(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
