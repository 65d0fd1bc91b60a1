"""The OpenAI-compatible server against the official `openai` client, on real uvicorn servers on loopback.

Server A: prefix reuse off, experts fit (streaming, batching exactness, cancellation, errors). Server B: an API
key, one sequence at a time, a queue of one, prefix reuse on, a budget holding a quarter of the experts (plus room
for sequence state).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from moestream.memory.state import BLOCK_HOST_BYTES  # noqa: E402
from moestream.server.app import ServerConfig, ServerState, create_app  # noqa: E402
from moestream.server.stops import StopMatcher  # noqa: E402

from conftest import expert_budget, prompt_ids, save_reference  # noqa: E402

VOCAB = 512
KEY = "sekrit-key"
STATE_ROOM = 256 << 10  # KV caches grow 256 rows (128 KiB here) at a time: leave them room beside the experts


def build_model(path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moestream.bpe import default_training_text, train_bpe_tokenizer

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096, initializer_range=0.2,
                         tie_word_embeddings=False)
    save_reference(Qwen3MoeForCausalLM, cfg, path)
    train_bpe_tokenizer([default_training_text(200_000)], VOCAB, path)


class LiveServer:
    """uvicorn on a free loopback port in a background thread."""

    def __init__(self, cfg: ServerConfig):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.state = ServerState.open(cfg)
        config = uvicorn.Config(create_app(self.state), host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"
        self.model = self.state.model_id

    def client(self, key: str = "none", **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def metrics(self, headers=None) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=headers).text
        return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("srv_model")
    build_model(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    s = LiveServer(ServerConfig(str(model_dir), max_batch=8, prefix_cache=0, max_body="64KiB", prefill_chunk=32))
    yield s
    s.close()


@pytest.fixture(scope="module")
def server_b(model_dir):
    s = LiveServer(ServerConfig(str(model_dir), max_batch=1, max_queue=1, api_key=KEY, prefix_cache="16MiB",
                                ram_budget=expert_budget(model_dir, 0.25) + STATE_ROOM))
    yield s
    s.close()


def _greedy_completion(client, model, prompt, n, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, **kw)


# ---- endpoints ------------------------------------------------------------------------------------------------
def test_models_health_metrics(server):
    assert [m.id for m in server.client().models.list().data] == [server.model]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("moestream_tokens_generated_total", "moestream_tokens_per_second", "moestream_expert_hit_rate",
                 "moestream_expert_bytes_read_total", "moestream_queue_depth", "moestream_active_sequences"):
        assert f"# TYPE {name} " in text


def test_chat_stream_matches_non_stream(server):
    c = server.client()
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    full = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    tok = server.state.tokenizer
    assert full.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(msgs)))
    assert 1 <= full.usage.completion_tokens <= 12
    chunks = list(c.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == choice.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_equals_engine_greedy(server):
    from moestream import Engine

    ids = prompt_ids(VOCAB, 20, seed=3)
    eng = Engine.open(server.state.cfg.model)
    want = eng.generate(ids, 16, stop_token_ids=server.state.tokenizer.eos_token_ids)
    c = server.client()
    got = _greedy_completion(c, server.model, ids, 16)
    assert got.choices[0].text == server.state.tokenizer.decode(want, skip_special_tokens=True)
    assert got.usage.completion_tokens == len(want) + (got.choices[0].finish_reason == "stop")
    streamed = list(c.completions.create(model=server.model, prompt=ids, max_tokens=16, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == got.choices[0].text


def test_logprobs(server):
    c = server.client()
    r = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                  temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy picks the top token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    comp = _greedy_completion(c, server.model, "def main():", 5, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)


def test_stop_matcher_across_pieces():
    m = StopMatcher(["END", "xyz"])
    assert m.feed("abcE") == ("abc", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dtail") == ("", True)
    m = StopMatcher(["END"])
    assert m.feed("aE") == ("a", False) and m.feed("x") == ("Ex", False) and m.flush() == ""


def _kv_state(mem, n: int):
    import torch

    from moestream.memory.state import SeqState
    from moestream.models.attention import KVSlot

    st = SeqState(mem, 2)
    for i in range(2):
        slot = st.slot(i, lambda: KVSlot(mem, 2, 4, 4))
        slot.k.append(torch.randn(n, 2, 4))
        slot.v.append(torch.randn(n, 2, 4))
    st.pos = n
    return st


def test_clone_state_deep_copies_and_accounts():
    import torch

    from moestream.memory.accountant import MemoryAccountant
    from moestream.server.prefix import PrefixCache, clone_state, truncatable

    mem = MemoryAccountant(None)
    kv = _kv_state(mem, 5)
    base = mem.state_bytes
    cut = clone_state(kv, 3)
    assert truncatable(kv) and cut.pos == 3 and cut.layers[1].v.length == 3
    assert torch.equal(cut.layers[1].v.view(), kv.layers[1].v.view()[:3])
    # layers x (k, v) x one 64-row block of [2, 4] fp32, each with its tensor object's host bytes
    assert mem.state_bytes == base + 2 * 2 * (64 * 2 * 4 * 4 + BLOCK_HOST_BYTES)
    cut.layers[0].k.blocks[0][0] += 1  # independent storage
    assert not torch.equal(cut.layers[0].k.view(), kv.layers[0].k.view()[:3])
    cut.release()
    assert mem.state_bytes == base

    class Recurrent:  # stands in for KDA state: a fixed-size matrix accounted with account_fixed
        def __init__(self):
            self.S = torch.randn(4, 4)

    rec = _kv_state(mem, 5)
    rec.layers[1].k.release()
    rec.layers[1].v.release()
    rec.layers[1] = Recurrent()
    rec.account_fixed(64)
    full = clone_state(rec)
    assert not truncatable(rec) and full.layers[1].S is not rec.layers[1].S
    assert torch.equal(full.layers[1].S, rec.layers[1].S) and full.fixed_bytes == 64
    with pytest.raises(ValueError):
        clone_state(rec, 3)

    cache = PrefixCache(limit=1 << 20)
    cache.save([1, 2, 3, 4, 5], kv)
    cache.save([1, 2, 9, 9, 9], rec)
    state, n = cache.lookup([1, 2, 3, 4, 7, 8])  # KV-only entry: cut back to the shared 4 tokens
    assert n == 4 and state.pos == 4
    state1, n1 = cache.lookup([1, 2, 9, 9, 8])  # the recurrent entry is only reusable whole: the KV one gives 2
    assert n1 == 2 and state1.fixed_bytes == 0
    state2, n2 = cache.lookup([1, 2, 9, 9, 9, 1])
    assert n2 == 5 and state2.fixed_bytes == 64
    for st in (state, state1, state2, full):
        st.release()
    cache.clear()
    assert mem.state_bytes == 0


def test_stop_string_spanning_tokens(server):
    c = server.client()
    ids = prompt_ids(VOCAB, 12, seed=5)
    full = _greedy_completion(c, server.model, ids, 24, logprobs=0)
    tokens, text = full.choices[0].logprobs.tokens, full.choices[0].text
    cut = next(i for i in range(2, len(tokens) - 1) if tokens[i] and tokens[i + 1])
    start = sum(len(t) for t in tokens[:cut])
    stop = text[start + len(tokens[cut]) - 1: start + len(tokens[cut]) + 1]  # last char of one token + next's first
    r = _greedy_completion(c, server.model, ids, 24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.find(stop)]
    streamed = list(c.completions.create(model=server.model, prompt=ids, max_tokens=24, temperature=0, stream=True,
                                         stop=stop))
    assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text


def test_seeded_sampling_repeats(server):
    c = server.client()
    a = c.completions.create(model=server.model, prompt="x = ", max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    b = c.completions.create(model=server.model, prompt="x = ", max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text


# ---- continuous batching --------------------------------------------------------------------------------------
def test_eight_concurrent_greedy_equal_alone(server):
    c = server.client()
    prompts = [prompt_ids(VOCAB, 10 + 7 * i, seed=100 + i) for i in range(8)]
    alone = [_greedy_completion(c, server.model, p, 24, logprobs=0) for p in prompts]
    before = server.metrics()
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _greedy_completion(c, server.model, p, 24, logprobs=0), prompts))
    after = server.metrics()
    for a, b in zip(alone, together):
        assert b.choices[0].logprobs.tokens == a.choices[0].logprobs.tokens
        assert b.choices[0].text == a.choices[0].text
    generated = after["moestream_tokens_generated_total"] - before["moestream_tokens_generated_total"]
    steps = after["moestream_engine_steps_total"] - before["moestream_engine_steps_total"]
    assert steps < generated * 0.6, "the concurrent requests were not decoded together"


def test_disconnect_cancels_and_frees_state(server):
    base = server.metrics()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"model": server.model, "prompt": "while True:", "max_tokens": 3000, "temperature": 0,
                            "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(ln.startswith("data: ") for ln in got)
    deadline = time.time() + 10
    while time.time() < deadline:
        m = server.metrics()
        if m["moestream_active_sequences"] == 0 and m["moestream_requests_cancelled_total"] > base[
                "moestream_requests_cancelled_total"]:
            break
        time.sleep(0.05)
    assert m["moestream_active_sequences"] == 0
    assert m["moestream_requests_cancelled_total"] == base["moestream_requests_cancelled_total"] + 1
    assert m["moestream_state_bytes"] == base["moestream_state_bytes"] == 0
    assert m["moestream_tokens_generated_total"] - base["moestream_tokens_generated_total"] < 3000


def test_one_failing_request_spares_the_others(server, monkeypatch):
    sched = server.state.scheduler
    original = sched._advance
    poison = prompt_ids(VOCAB, 9, seed=77)

    def advance(seq, logits):
        if seq.ticket.req.prompt_ids == poison:
            raise RuntimeError("injected fault")
        return original(seq, logits)

    monkeypatch.setattr(sched, "_advance", advance)
    c = server.client()
    with ThreadPoolExecutor(3) as pool:
        good = [pool.submit(_greedy_completion, c, server.model, prompt_ids(VOCAB, 9, seed=s), 20) for s in (1, 2)]
        bad = pool.submit(_greedy_completion, c, server.model, poison, 20)
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            bad.result()
        assert all(f.result().usage.completion_tokens >= 1 for f in good)
    assert httpx.get(server.url + "/health").status_code == 200


# ---- failure behaviour ----------------------------------------------------------------------------------------
def _post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=30)


@pytest.mark.parametrize("extra,param", [({"tools": []}, "tools"), ({"logit_bias": {"1": 500}}, "logit_bias"),
                                         ({"n": 0}, "n"), ({"top_logprobs": 9, "logprobs": True}, "top_logprobs"),
                                         ({"response_format": {"type": "xml"}}, "response_format"),
                                         ({"tool_choice": "required"}, "tool_choice"),
                                         ({"functions": []}, "functions")])
def test_unsupported_field_is_400_naming_it(server, extra, param):
    r = _post(server, "/v1/chat/completions", {"model": server.model, "messages": [{"role": "user", "content": "a"}],
                                              **extra})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def test_openai_client_sees_400(server):
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        server.client().completions.create(model=server.model, prompt="a", frequency_penalty=1.0)


def test_malformed_json_oversized_unknown_model_and_route(server):
    r = _post(server, "/v1/completions", content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": "a" * 70_000})
    assert r.status_code == 413 and "error" in r.json()
    r = _post(server, "/v1/completions", {"model": "nope", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert _post(server, "/v1/embeddings", {"model": server.model}).status_code == 404
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": [VOCAB + 3]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_api_key(server_b):
    with pytest.raises(openai.AuthenticationError):
        server_b.client("wrong").models.list()
    assert httpx.get(server_b.url + "/v1/models").status_code == 401
    assert httpx.get(server_b.url + "/metrics").status_code == 401
    assert httpx.get(server_b.url + "/health").status_code == 200
    assert [m.id for m in server_b.client(KEY).models.list().data] == [server_b.model]


def test_full_queue_is_429_with_retry_after(server_b):
    body = {"model": server_b.model, "prompt": "for i in", "max_tokens": 400, "temperature": 0, "stream": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=30, headers=auth) as http:
        with http.stream("POST", server_b.url + "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the connection
            next(lines)  # running (max_batch 1)
            with http.stream("POST", server_b.url + "/v1/completions", json=body) as second:
                assert second.status_code == 200  # waiting (max_queue 1)
                third = http.post(server_b.url + "/v1/completions", json=body)
                assert third.status_code == 429 and third.headers["retry-after"] == "1"
                assert third.json()["error"]["type"] == "rate_limit_error"
    deadline = time.time() + 10
    while server_b.metrics(auth)["moestream_active_sequences"] and time.time() < deadline:
        time.sleep(0.05)


def test_prefix_reuse_under_quarter_budget(server, server_b):
    c = server_b.client(KEY)
    ids = prompt_ids(VOCAB, 40, seed=11)
    first = _greedy_completion(c, server_b.model, ids, 8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    longer = ids + prompt_ids(VOCAB, 6, seed=12)
    second = _greedy_completion(c, server_b.model, longer, 10)
    assert second.usage.prompt_tokens_details.cached_tokens == len(ids)
    fresh = _greedy_completion(server.client(), server.model, longer, 10)  # server A recomputes everything
    assert second.choices[0].text == fresh.choices[0].text
    eng = server_b.state.engine
    assert eng.stats["expert_evictions"] > 0 and eng.stats["peak_resident_bytes"] <= eng.memory.budget
    m = server_b.metrics({"Authorization": f"Bearer {KEY}"})
    assert m["moestream_prompt_tokens_reused_total"] >= len(ids) and m["moestream_prefix_cache_bytes"] > 0


def test_stream_error_mid_request_is_json(server):
    r = _post(server, "/v1/chat/completions", {"model": server.model, "messages": [{"role": "user", "content": "a"}],
                                              "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    assert json.loads(_post(server, "/v1/chat/completions", {"model": server.model, "messages": []}).text)["error"][
        "param"] == "messages"


def serve_process(model_dir, *args: str):
    """`moestream serve MODEL_DIR ARGS` in a subprocess on a free loopback port; returns (process, url) once its
    /health answers."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "serve", str(model_dir), "--port", str(port), *args])
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError("moestream serve did not come up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)


def test_moestream_serve_command(model_dir):
    import subprocess
    import sys

    proc, url = serve_process(model_dir, "--api-key", KEY, "--max-batch", "2", "--threads", "1")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        r = client.completions.create(model=model_dir.name, prompt="import os", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "moestream", "serve", str(model_dir), "--max-batch", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--max-batch" in bad.stderr
