"""Fuzzes `moestream serve` with random request bodies and checks every answer and the server's memory.

Bodies come from hypothesis strategies: mutated valid requests (each known field set to junk: wrong types, out of
range, NaN/inf, huge and empty values, unicode, nested junk), unknown fields, arbitrary JSON and raw bytes, for every
endpoint. Every answer must be a 2xx, or a 4xx in OpenAI's error shape (never a 5xx, never a hang); streams must
be well-formed. After each burst the server must be back to its baseline: no active or queued sequence, no state
outside the prefix cache, the same resident bytes outside the expert and prefix caches.

    python bench/fuzz_server.py --serve MODEL_DIR --requests 10000     # starts its own server on loopback
    python bench/fuzz_server.py --url http://127.0.0.1:8000 --model ID

Use a checkpoint with a short context (max_position_embeddings of a few hundred): a valid body without
max_tokens generates up to the end of the context. The test suite runs the same checks on a few hundred bodies.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

POST_ROUTES = ("/v1/chat/completions", "/v1/completions")
GET_ROUTES = ("/v1/models", "/health", "/metrics")
CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
               "stream", "stream_options", "logprobs", "top_logprobs", "user", "presence_penalty",
               "frequency_penalty", "tools", "tool_choice", "response_format", "logit_bias")
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                     "stream_options", "logprobs", "echo", "best_of", "user", "presence_penalty", "frequency_penalty")
ERROR_KEYS = {"message", "type", "param", "code"}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
                    st.sampled_from(["", "<|im_end|><|im_start|>system\n", "\x00", "\ud7ff\ue000", "a" * 5000]))
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                     st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                    max_leaves=20)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                                            "content": st.one_of(st.text(max_size=60), junk)}), max_size=3)


def bodies(model: str) -> st.SearchStrategy:
    """(method, route, body): a body is a JSON value, or raw bytes sent as-is."""
    def mutated(route: str, base: dict, fields: tuple[str, ...]) -> st.SearchStrategy:
        changes = st.dictionaries(st.one_of(st.sampled_from(fields), st.text(max_size=12)), junk, max_size=3)
        drops = st.lists(st.sampled_from(list(base)), max_size=2)
        return st.builds(lambda c, d: ("POST", route, {k: v for k, v in {**base, **c}.items() if k not in d}),
                         changes, drops)

    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    completion = {"model": model, "prompt": "def f(", "max_tokens": 4}
    valid_chat = st.builds(lambda m, s, n: ("POST", POST_ROUTES[0], {**chat, "messages": m or chat["messages"],
                                                                    "stream": s, "max_tokens": n}),
                           messages, st.booleans(), st.integers(1, 8))
    other_model = st.builds(lambda name: ("POST", POST_ROUTES[1], {**completion, "model": name}),
                            st.text(min_size=1, max_size=20).filter(lambda name: name != model))
    oversized = st.tuples(st.just("POST"), st.sampled_from(POST_ROUTES), st.just(b" " * (2 << 20)))  # > --max-body
    return st.one_of(mutated(POST_ROUTES[0], chat, CHAT_FIELDS), mutated(POST_ROUTES[1], completion, COMPLETION_FIELDS),
                     valid_chat, other_model, oversized, st.tuples(st.just("POST"), st.sampled_from(POST_ROUTES), junk),
                     st.tuples(st.just("POST"), st.sampled_from(POST_ROUTES), st.binary(max_size=64)),
                     st.tuples(st.just("GET"), st.sampled_from(GET_ROUTES), st.none()))


def problem(status: int, body: bytes, stream: bool) -> str | None:
    """What is wrong with one answer, or None."""
    if not (200 <= status < 300 or 400 <= status < 500):
        return f"status {status}"
    if status >= 400:
        try:
            err = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without an OpenAI error body"
        if set(err) != ERROR_KEYS or not isinstance(err["message"], str) or not isinstance(err["type"], str):
            return f"{status} error body of the wrong shape"
        return None
    if stream:
        lines = [ln for ln in body.decode().split("\n") if ln.startswith("data: ")]
        if not lines or lines[-1] != "data: [DONE]":
            return "a stream that does not end with [DONE]"
        for ln in lines[:-1]:
            event = json.loads(ln[6:])
            if "error" in event:
                return f"an error inside a stream: {event['error'].get('message', '')[:80]}"
    return None


def send(http: httpx.Client, url: str, method: str, route: str, body) -> tuple[int, str | None]:
    if method == "GET":
        r = http.get(url + route)
        return r.status_code, problem(r.status_code, r.content, False) if r.status_code >= 400 else None
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    stream = isinstance(body, dict) and body.get("stream") is True
    r = http.post(url + route, content=raw, headers={"content-type": "application/json"})
    return r.status_code, problem(r.status_code, r.content, stream)


def metrics(http: httpx.Client, url: str) -> dict[str, float]:
    text = http.get(url + "/metrics").text
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


def settled(http: httpx.Client, url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs or waits (the engine figures are refreshed at most every 0.5 s when idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(http, url)
        if (m["moestream_active_sequences"] == 0 and m["moestream_queue_depth"] == 0) or time.monotonic() > deadline:
            time.sleep(0.6)
            return metrics(http, url)
        time.sleep(0.05)


def outside_caches(m: dict[str, float]) -> float:
    """Resident bytes that are neither cached experts nor saved prefixes: dense, scratch, live state."""
    return m["moestream_resident_bytes"] - m["moestream_expert_cache_bytes"] - m["moestream_prefix_cache_bytes"]


def leaks(m: dict[str, float], baseline: float) -> float:
    """Bytes held beyond the baseline once idle (0 when nothing leaked)."""
    live = m["moestream_state_bytes"] - m["moestream_prefix_cache_bytes"]
    return max(0.0, live) + abs(outside_caches(m) - baseline) + m["moestream_active_sequences"]


def fuzz(url: str, model: str, n: int, burst: int, seed: int | None = None) -> dict:
    statuses: Counter = Counter()
    problems: Counter = Counter()
    leaked: list[float] = []
    with httpx.Client(timeout=60) as http:
        baseline = outside_caches(settled(http, url))

        @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate], derandomize=seed is not None,
                  suppress_health_check=list(HealthCheck))
        @given(bodies(model))
        def run(case):
            status, bad = send(http, url, *case)
            statuses[status] += 1
            if bad:
                problems[bad] += 1
            if sum(statuses.values()) % burst == 0:
                leaked.append(leaks(settled(http, url), baseline))

        run()
        leaked.append(leaks(settled(http, url), baseline))
    return {"requests": sum(statuses.values()), "by_status": dict(sorted(statuses.items())),
            "outside_error_shape": sum(problems.values()), "problems": dict(problems.most_common(10)),
            "leaked_bytes_max": max(leaked), "bursts": len(leaked)}


def start_server(model_dir: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "serve", model_dir, "--port", str(port), *extra])
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit("the server did not start")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", metavar="MODEL_DIR", help="start `moestream serve MODEL_DIR` on loopback")
    ap.add_argument("--url", help="an already running server")
    ap.add_argument("--model", help="model id (default: the --serve directory's name)")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--burst", type=int, default=500, help="requests between leak checks")
    ap.add_argument("--server-args", default="--threads 1 --max-batch 4 --max-body 1MiB --prefix-cache 8MiB",
                    help="extra arguments for --serve")
    args = ap.parse_args()
    if not (args.serve or args.url):
        ap.error("give --serve MODEL_DIR or --url")
    proc = None
    url = args.url
    if args.serve:
        proc, url = start_server(args.serve, args.server_args.split())
    model = args.model or Path(args.serve or "").name
    try:
        t0 = time.monotonic()
        report = fuzz(url, model, args.requests, args.burst)
        report["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
