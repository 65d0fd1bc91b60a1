"""Soak test for `moestream serve`: concurrent streaming clients for minutes, with misbehaving ones among them.

Each client loops until the time or request limit: a complete streamed completion, or (in the given shares) one it
disconnects from mid-stream, a non-streamed one it cancels while waiting, an oversized body (413) or a malformed one
(400). A flood task periodically sends more requests at once than the queue holds (429s expected). It reports
requests served, answers by status, p50/p99 latency of complete answers, the server's RSS over time, and checks
that every well-formed request got a complete answer (or a 429 in a flood), that nothing hung, and that once idle no
sequence, state or resident byte is left beyond the baseline. Loopback only.

    python bench/soak.py --serve MODEL_DIR --minutes 10 --clients 16 --disconnect 0.3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fuzz_server import leaks, outside_caches, settled, start_server
from moestream.cgroup import proc_kib

HANG_S = 120.0  # an answer slower than this counts as a hang


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    incomplete: list[str] = field(default_factory=list)  # well-formed requests without a complete answer
    hangs: int = 0
    refused: int = 0  # well-formed requests answered 429 while a flood filled the queue
    latency: list[float] = field(default_factory=list)  # seconds, complete streamed answers
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)


def _body(model: str, rng: random.Random, stream: bool) -> dict:
    return {"model": model, "prompt": [rng.randrange(1, 400) for _ in range(rng.randint(4, 48))],
            "max_tokens": rng.randint(8, 48), "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1000),
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


async def complete_stream(http: httpx.AsyncClient, url: str, body: dict, t: Tally, cut_after: int | None) -> None:
    """Stream one completion; with `cut_after`, disconnect after that many chunks (not a failure)."""
    start, chunks, finish, done = time.monotonic(), 0, None, False
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        t.statuses[r.status_code] += 1
        if r.status_code == 429:
            t.refused += 1  # a flood filled the queue: a clear answer, not a failure
            return
        if r.status_code != 200:
            t.incomplete.append(f"stream answered {r.status_code}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                t.incomplete.append(f"error event: {event['error']['message'][:80]}")
                return
            chunks += 1
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
            if cut_after is not None and chunks >= cut_after:
                return  # leaving the block closes the connection mid-stream
    if not (done and finish in ("stop", "length")):
        t.incomplete.append(f"stream ended without finish_reason/[DONE] ({finish}, {done})")
    else:
        t.latency.append(time.monotonic() - start)


async def cancelled(http: httpx.AsyncClient, url: str, body: dict, rng: random.Random, t: Tally) -> None:
    try:
        r = await asyncio.wait_for(http.post(url + "/v1/completions", json=body), rng.uniform(0.05, 0.5))
        t.statuses[r.status_code] += 1  # it finished before the client gave up
    except asyncio.TimeoutError:
        pass


async def bad_body(http: httpx.AsyncClient, url: str, kind: str, max_body: int, t: Tally) -> None:
    content = b"{" * (max_body + 1) if kind == "oversized" else b'{"model": "m", "prompt": [1, 2,'
    r = await http.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    t.statuses[r.status_code] += 1
    want = 413 if kind == "oversized" else 400
    if r.status_code != want or "error" not in r.json():
        t.incomplete.append(f"{kind} body answered {r.status_code}")


async def client(i: int, url: str, model: str, args, deadline: float, budget: list[int], t: Tally) -> None:
    rng = random.Random(args.seed * 1000 + i)
    async with httpx.AsyncClient(timeout=HANG_S) as http:
        while time.monotonic() < deadline and budget[0] > 0:
            budget[0] -= 1
            roll = rng.random()
            kind = ("disconnect" if roll < args.disconnect else "cancel" if roll < args.disconnect + args.cancel
                    else "oversized" if roll < args.disconnect + args.cancel + args.bad / 2
                    else "malformed" if roll < args.disconnect + args.cancel + args.bad else "complete")
            t.kinds[kind] += 1
            try:
                if kind in ("complete", "disconnect"):
                    cut = rng.randint(1, 4) if kind == "disconnect" else None
                    await complete_stream(http, url, _body(model, rng, True), t, cut)
                elif kind == "cancel":
                    await cancelled(http, url, _body(model, rng, False), rng, t)
                else:
                    await bad_body(http, url, kind, args.max_body, t)
            except httpx.TimeoutException:
                t.hangs += 1


async def flood(url: str, model: str, args, deadline: float, t: Tally) -> None:
    """Every `flood_every` seconds, more short requests at once than --max-batch + --max-queue admit."""
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=HANG_S, limits=httpx.Limits(max_connections=None)) as http:
        while time.monotonic() + args.flood_every < deadline:
            await asyncio.sleep(args.flood_every)
            bodies = [_body(model, rng, False) | {"max_tokens": 4} for _ in range(args.flood_size)]
            answers = await asyncio.gather(*(http.post(url + "/v1/completions", json=b) for b in bodies),
                                           return_exceptions=True)
            for a in answers:
                t.kinds["flood"] += 1
                if isinstance(a, Exception):
                    t.hangs += isinstance(a, httpx.TimeoutException)
                    t.incomplete.append(f"flood: {type(a).__name__}")
                    continue
                t.statuses[a.status_code] += 1
                if a.status_code not in (200, 429) or (a.status_code == 200 and not a.json().get("choices")):
                    t.incomplete.append(f"flood answered {a.status_code}")


async def sample_rss(pid: int | None, start: float, deadline: float, t: Tally) -> None:
    while pid is not None and time.monotonic() < deadline:
        rss = proc_kib("VmRSS", f"/proc/{pid}/status")
        if rss is not None:
            t.rss.append((round(time.monotonic() - start, 1), rss * 1024))
        await asyncio.sleep(10)


async def soak(url: str, model: str, args, pid: int | None) -> Tally:
    t = Tally()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    budget = [args.max_requests]
    await asyncio.gather(sample_rss(pid, start, deadline, t), flood(url, model, args, deadline, t),
                         *(client(i, url, model, args, deadline, budget, t) for i in range(args.clients)))
    return t


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", metavar="MODEL_DIR", required=True, help="start `moestream serve MODEL_DIR` on loopback")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--max-requests", type=int, default=200_000, help="stop after this many client requests")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--disconnect", type=float, default=0.3, help="share of requests abandoned mid-stream")
    ap.add_argument("--cancel", type=float, default=0.05, help="share of non-streamed requests given up early")
    ap.add_argument("--bad", type=float, default=0.05, help="share of oversized or malformed bodies")
    ap.add_argument("--flood-every", type=float, default=60.0, help="seconds between queue floods")
    ap.add_argument("--flood-size", type=int, default=120)
    ap.add_argument("--max-body", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="--threads 1 --max-batch 8 --max-queue 64 --prefix-cache 16MiB")
    args = ap.parse_args()
    proc, url = start_server(args.serve, [*args.server_args.split(), "--max-body", str(args.max_body)])
    model = Path(args.serve).name
    try:
        with httpx.Client(timeout=60) as http:
            baseline = outside_caches(settled(http, url))
            t0 = time.monotonic()
            t = asyncio.run(soak(url, model, args, proc.pid))
            elapsed = time.monotonic() - t0
            after = settled(http, url)
    finally:
        proc.terminate()
        exit_code = proc.wait(60)
    rss = [b for _, b in t.rss]
    report = {
        "minutes": round(elapsed / 60, 2), "clients": args.clients, "requests": sum(t.kinds.values()),
        "by_kind": dict(t.kinds), "by_status": dict(sorted(t.statuses.items())),
        "served_complete": len(t.latency), "refused_429_during_floods": t.refused,
        "latency_p50_s": round(_pct(t.latency, 0.5), 3),
        "latency_p99_s": round(_pct(t.latency, 0.99), 3), "hangs": t.hangs,
        "well_formed_without_complete_answer": len(t.incomplete), "examples": t.incomplete[:5],
        "leaked_bytes": leaks(after, baseline), "open_sequences": after["moestream_active_sequences"],
        "prefix_cache_mib_at_end": round(after["moestream_prefix_cache_bytes"] / 2**20, 1),
        "rss_mib_first_last_max": [round(x / 2**20, 1) for x in (rss[0], rss[-1], max(rss))] if rss else None,
        "rss_mib_over_time": [f"{s:g}s:{b / 2**20:.1f}" for s, b in t.rss], "server_exit_code": exit_code,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
