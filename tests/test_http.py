"""Remote checkpoints over a real HTTP server on loopback (tests/hfserver.py): hub-style hf:// and plain URLs,
headers-only info, greedy tokens and logits equal to the local run, the SSD tier (warm runs fetch nothing,
offline runs, corruption detected, budget kept, atomic ranges) and injected faults."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hfserver import SHA, CheckpointServer  # noqa: E402

from moestream.engine.engine import Engine  # noqa: E402
from moestream.errors import CheckpointError  # noqa: E402
from moestream.weights import remote  # noqa: E402
from moestream.weights.diskcache import DiskCache  # noqa: E402

PROMPT = [5, 17, 42, 99, 3, 250, 7, 11]
NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from moestream.synth import synthesize

    root = tmp_path_factory.mktemp("ckpt")
    d = root / "tiny"
    synthesize("qwen3_moe", d, "tiny", cache_dir=root / "cache", progress=False)
    return d


@pytest.fixture(scope="module")
def local(ckpt):
    eng = Engine.open(ckpt)
    try:
        return eng.generate(PROMPT, NEW, stop_token_ids=[]), eng.logits(PROMPT)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def server(ckpt):
    with CheckpointServer({"org/tiny": ckpt}) as s:
        yield s


@pytest.fixture
def env(server, tmp_path, monkeypatch):
    """Fresh remote settings per test: the hub endpoint is the loopback server, caches under tmp_path."""
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for k, v in vars(remote.RemoteSettings()).items():
        monkeypatch.setattr(remote.SETTINGS, k, v)
    monkeypatch.setattr(remote.SETTINGS, "http_timeout_s", 1.0)
    server.faults.clear()
    server.fault_filter = ""
    server.etag_salt = ""
    server.log.clear()
    server.token = None
    return remote.SETTINGS


def run_remote(spec: str, lookahead: bool = True):
    eng = Engine.open(remote.resolve(spec))
    eng.runner.lookahead.enabled = lookahead  # off: only what routing demands is read (no timing-dependent guesses)
    try:
        got = eng.generate(PROMPT, NEW, stop_token_ids=[]), eng.logits(PROMPT)
    finally:
        eng.close()
    # counted after close, which waits for the SSD tier's write-behind (a loaded machine's writer may not have
    # written, nor evicted for, the last ranges before then)
    return (*got, eng.plan.store.index.stats())


def test_info_reads_only_headers(env, server, ckpt):
    from moestream.info import model_info

    stub = remote.resolve("hf://org/tiny", full=False)
    assert stub.name == SHA  # "main" pinned to the commit hash
    assert model_info(stub).to_json()["total_params"] == model_info(ckpt).to_json()["total_params"]
    assert not (stub / "tokenizer.json").exists()  # only config.json, the index json and the headers
    assert sorted(p.name for p in stub.iterdir()) == ["config.json", "model.safetensors.index.json",
                                                      "moestream-remote.json"]
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    ranges = [(p.rsplit("/", 1)[1], a, b) for p, a, b, _ in server.settled()]
    assert sorted({r[0] for r in ranges}) == shards
    for name in shards:  # two range requests per shard: the 8-byte length, then the header
        mine = sorted((a, b) for n, a, b in ranges if n == name)
        assert len(mine) == 2 and mine[0] == (0, 8) and mine[1][0] == 8


def test_hf_run_equals_local_and_warm_cache_fetches_nothing(env, server, local, tmp_path):
    env.disk_cache = tmp_path / "dc"
    tokens, logits, stats = run_remote("hf://org/tiny")
    assert tokens == local[0]
    assert torch.equal(logits, local[1])
    assert stats["http_bytes"] > 0 and stats["disk_put_bytes"] > 0
    served = server.bytes_served()
    tokens2, _, stats2 = run_remote(f"hf://org/tiny@{SHA}", lookahead=False)  # a commit: no listing call either
    assert tokens2 == local[0]
    assert stats2["http_bytes"] == 0 and stats2["http_requests"] == 0 and server.bytes_served() == served
    assert DiskCache(env.disk_cache).verify_all()[1] == 0


def test_plain_url_and_offline(env, server, local, tmp_path):
    env.disk_cache = tmp_path / "dc"
    url = f"{server.url}/plain/org/tiny/"
    assert run_remote(url)[0] == local[0]
    env.offline = True
    assert run_remote(url)[0] == local[0]  # config, headers and every range come from disk


def test_offline_without_cache_names_what_is_missing(env, tmp_path):
    env.disk_cache, env.offline = tmp_path / "dc", True
    with pytest.raises(CheckpointError, match="offline: hf://org/tiny was never opened"):
        remote.resolve("hf://org/tiny")
    env.offline = False
    stub = remote.resolve("hf://org/tiny")  # headers cached, no ranges
    env.offline = True
    with pytest.raises(CheckpointError, match=r"offline: bytes \[\d+, \d+\) of model-.*not in the disk cache"):
        Engine.open(stub)


@pytest.mark.parametrize("fault", ["drop", "truncate", "500", "503", "429", "bad_range", "stall"])
def test_faults_are_retried_and_never_cached(env, server, local, tmp_path, fault):
    env.disk_cache = tmp_path / "dc"
    stub = remote.resolve("hf://org/tiny")
    server.faults[:] = [fault, fault]
    eng = Engine.open(stub)
    try:
        assert eng.generate(PROMPT, NEW, stop_token_ids=[]) == local[0]
        assert eng.plan.store.index.stats()["http_retries"] >= 2
    finally:
        eng.close()
    assert not server.faults
    checked, bad = DiskCache(env.disk_cache).verify_all()
    assert checked > 0 and bad == 0


def test_changed_etag_is_refused(env, server, tmp_path):
    env.disk_cache = tmp_path / "dc"
    stub = remote.resolve("hf://org/tiny")
    server.faults[:] = ["etag"]
    with pytest.raises(CheckpointError, match="changed on the server"):
        Engine.open(stub)
    # the response with the new ETag left nothing behind: every cached range predates it and verifies
    assert DiskCache(env.disk_cache).verify_all()[1] == 0


def test_corrupt_range_on_disk_is_detected_and_refetched(env, server, local, tmp_path):
    env.disk_cache = tmp_path / "dc"
    run_remote("hf://org/tiny")
    files = sorted((env.disk_cache / "ranges").rglob("*.rng"), key=lambda f: f.stat().st_size)
    victim = files[-1]  # the dense weights' merged range: every open reads it
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(raw)
    tokens, _, stats = run_remote(f"hf://org/tiny@{SHA}", lookahead=False)
    assert tokens == local[0]
    assert stats["disk_corrupt_ranges"] == 1 and stats["http_bytes"] > 0
    checked, bad = DiskCache(env.disk_cache).verify_all()
    assert checked >= len(files) and bad == 0


def test_disk_budget_is_kept(env, local, tmp_path):
    env.disk_cache, env.disk_budget = tmp_path / "dc", 400_000
    tokens, _, stats = run_remote("hf://org/tiny")
    assert tokens == local[0]
    cache = DiskCache(env.disk_cache)
    on_disk = sum(f.stat().st_size for f in (env.disk_cache / "ranges").rglob("*.rng"))
    assert stats["disk_evicted_bytes"] > 0 and on_disk <= 400_000 and cache.usage() == on_disk


def test_gated_repo_needs_token_and_cdn_never_sees_it(env, server, local, monkeypatch):
    server.token = "sekret"
    with pytest.raises(CheckpointError, match="gated repository"):
        remote.resolve("hf://org/tiny")
    monkeypatch.setenv("HF_TOKEN", "sekret")
    assert run_remote("hf://org/tiny")[0] == local[0]  # /cdn answers 401 to a token, so none was sent there


def test_unknown_revision_and_repo(env):
    with pytest.raises(CheckpointError, match="no revision 'nope'"):
        remote.resolve("hf://org/tiny@nope")
    with pytest.raises(CheckpointError, match="no such repository"):
        remote.resolve("hf://org/absent")


def test_unreachable_hub_is_a_clear_error(env, monkeypatch, capsys):
    """A hub that cannot be reached (nothing listens there) is an error naming it and --offline, from the API and
    from the command line, not a traceback from the HTTP library underneath."""
    import socket

    from moestream.cli import main

    with socket.socket() as s:  # a loopback port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(CheckpointError, match=f"cannot reach http://127.0.0.1:{port}.*--offline"):
        remote.resolve("hf://org/tiny")
    assert main(["info", "hf://org/tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hf://org/tiny: cannot reach") and "Traceback" not in err


def test_cli_info_fetch_then_offline_run(env, server, tmp_path, capsys):
    from moestream.cli import main

    dc = str(tmp_path / "dc")
    assert main(["info", "hf://org/tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "hf://org/tiny" and out["revision"] == SHA
    assert main(["fetch", "hf://org/tiny", "--disk-cache", dc]) == 0
    served = server.bytes_served()
    assert main(["fetch", "hf://org/tiny", "--disk-cache", dc]) == 0  # resumable: nothing left to fetch
    assert server.bytes_served() == served
    assert main(["run", "hf://org/tiny", "--disk-cache", dc, "--offline", "--prompt", "hi", "--max-new", "3"]) == 0
    assert server.bytes_served() == served
    env.offline = False  # the CLI's flags set the process's settings
    assert main(["fetch", "hf://org/tiny", "--disk-cache", str(tmp_path / "dc2"), "--disk-budget", "1000"]) == 2
    assert "more than --disk-budget" in capsys.readouterr().err


def test_dense_weights_fetched_ahead_in_merged_requests(env, server, local, tmp_path):
    env.disk_cache = tmp_path / "dc"
    stub = remote.resolve("hf://org/tiny")
    server.log.clear()
    eng = Engine.open(stub)
    try:
        dense = eng.plan.dense_names
        stats = eng.plan.store.index.stats()
        assert eng.generate(PROMPT, NEW, stop_token_ids=[]) == local[0]
    finally:
        eng.close()
    # every dense byte fetched once, in fewer requests than there are dense tensors, then read from disk
    assert stats["http_requests"] < len(dense) and stats["http_bytes"] == eng.plan.dense_bytes
    assert stats["disk_hit_bytes"] == eng.plan.dense_bytes


def test_neighbouring_experts_share_a_request(env, server, local, tmp_path):
    stub = remote.resolve("hf://org/tiny")
    eng = Engine.open(stub)
    try:
        server.log.clear()
        assert eng.generate(PROMPT, NEW, stop_token_ids=[]) == local[0]
        expert = eng.plan.store.expert_nbytes(eng.plan.layout.moe_layers[0], 0)
        longest = max(b - a for p, a, b, _ in server.settled())
    finally:
        eng.close()
    assert longest >= 2 * expert  # the prefill's experts of a layer were queued together and coalesced


def test_fetch_hot_takes_dense_and_hottest_experts(env, server, tmp_path):
    from moestream.cli import main
    from moestream.cli.fetch import check_space
    from moestream.errors import MoestreamError
    from moestream.experts.policies import heat_path

    env.disk_cache = tmp_path / "dc"
    stub = remote.resolve("hf://org/tiny")
    assert main(["fetch", "hf://org/tiny", "--hot", "1"]) == 2  # no heat recorded yet
    rows = [[layer, expert, float(expert)] for layer in range(4) for expert in range(16)]
    heat_path(stub).parent.mkdir(parents=True, exist_ok=True)
    heat_path(stub).write_text(json.dumps({"version": 1, "heat": rows}))
    server.log.clear()
    assert main(["fetch", "hf://org/tiny", "--hot", "1"]) == 0
    from moestream.engine.engine import plan

    p = plan(stub)
    try:
        cache = p.store.index.cache
        for layer in p.layout.moe_layers:
            hot, cold = p.store.locate(layer, 15)[0], p.store.locate(layer, 0)[0]
            assert cache.covered(hot.file.key, hot.offset, hot.nbytes)
            assert not cache.covered(cold.file.key, cold.offset, cold.nbytes)
    finally:
        p.store.close()
    with pytest.raises(MoestreamError, match="not enough disk space"):
        check_space(tmp_path, 1 << 60, 1 << 60, None)


def test_two_processes_fetch_into_one_cache(env, server, tmp_path):
    import os
    import subprocess

    dc = tmp_path / "dc"
    code = "import sys; from moestream.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "fetch", "hf://org/tiny", "--disk-cache", str(dc)]
    environ = {**os.environ, "HF_ENDPOINT": server.url}
    procs = [subprocess.Popen(cmd, env=environ, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    cache = DiskCache(dc)
    checked, bad = cache.verify_all()
    on_disk = sum(f.stat().st_size for f in (dc / "ranges").rglob("*.rng"))
    assert checked > 0 and bad == 0 and cache.usage() == on_disk
    assert not list((dc / "tmp").iterdir())  # no temp file left behind


def test_retry_after_and_etag_forms():
    import email.utils
    import time as _time

    from moestream.weights.http import normalize_etag, retry_after

    assert retry_after("3") == 3.0 and retry_after(None) is None and retry_after("soon") is None
    assert 5 < retry_after(email.utils.formatdate(_time.time() + 10, usegmt=True)) <= 10
    assert normalize_etag('W/"abc"') == normalize_etag('"abc"') == '"abc"'


def test_engine_open_and_plan_take_a_remote_spec(env, server, local, tmp_path):
    from moestream.engine.engine import plan

    env.disk_cache = tmp_path / "dc"
    p = plan("hf://org/tiny")  # headers only: no tokenizer fetched, no weight bytes
    try:
        assert p.store.index.root.name == SHA and not (p.store.index.root / "tokenizer.json").exists()
        assert p.store.index.stats()["http_bytes"] == 0
    finally:
        p.store.close()
    eng = Engine.open("hf://org/tiny")  # the Python API resolves the spec itself
    try:
        assert eng.path.name == SHA and (eng.path / "tokenizer.json").exists()
        assert eng.generate(PROMPT, NEW, stop_token_ids=[]) == local[0]
    finally:
        eng.close()
    eng = Engine.open(f"{server.url}/plain/org/tiny/")
    try:
        assert eng.generate(PROMPT, NEW, stop_token_ids=[]) == local[0]
    finally:
        eng.close()


def test_trace_bench_and_batch_take_a_remote_spec(env, server, tmp_path, capsys):
    from moestream.cli import main

    dc = str(tmp_path / "dc")
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\nimport os\n")
    assert main(["trace", "hf://org/tiny", "--prompts", str(prompts), "--max-new-tokens", "2",
                 "--disk-cache", dc]) == 0
    assert "cache hit rate" in capsys.readouterr().out
    assert main(["bench", "hf://org/tiny", "--prompt-len", "4", "--gen-len", "2", "--json", "--no-probe",
                 "--threads", "1", "--disk-cache", dc]) == 0
    assert json.loads(capsys.readouterr().out)["decode_tokens_per_s"] > 0
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"model": "hf://org/tiny", "prompt": "Once upon", "max_tokens": 2, "temperature": 0}
    inp.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    assert main(["batch", "hf://org/tiny", str(inp), "-o", str(out), "--disk-cache", dc, "--no-progress"]) == 0
    line = json.loads(out.read_text())
    assert line["custom_id"] == "a" and line["response"]["status_code"] == 200, line
    served = server.bytes_served()
    env.offline = True  # everything those runs read is in the disk cache now
    assert main(["trace", "hf://org/tiny", "--prompts", str(prompts), "--max-new-tokens", "2", "--disk-cache", dc,
                 "--offline"]) == 0
    assert server.bytes_served() == served


def test_large_range_goes_as_parallel_requests(tmp_path):
    import os

    from moestream.weights.http import SPLIT_PART, HttpClient

    blob = os.urandom(3 * SPLIT_PART + 5000)
    (tmp_path / "blob.bin").write_bytes(blob)
    with CheckpointServer({"org/blob": tmp_path}) as srv:
        client = HttpClient()
        try:
            url = f"{srv.url}/plain/org/blob/blob.bin"
            etag, size = client.get_range(url, 0, memoryview(bytearray(8)))
            out = bytearray(len(blob) - 100)
            assert client.get_range(url, 100, memoryview(out), size, etag) == (etag, size)
        finally:
            client.close()
        assert bytes(out) == blob[100:]
        parts = sorted((a, b) for _, a, b, _ in srv.settled()[1:])
        assert len(parts) == 3 and parts[0][0] == 100 and parts[-1][1] == len(blob)
        assert all(parts[i][1] == parts[i + 1][0] for i in range(2))  # contiguous, no byte twice


def test_range_body_lands_without_urllib3_copies_and_keeps_the_connection(tmp_path, monkeypatch):
    """A range's body goes from the socket into the caller's buffer (http.client's readinto), never through
    urllib3's `read` (which allocates and copies the body twice); the connection goes back to the pool and is used
    again, and a short body is still a transient failure, retried."""
    import os

    import urllib3

    from moestream.weights.http import HttpClient, RetryPolicy

    blob = os.urandom(1 << 20)
    (tmp_path / "blob.bin").write_bytes(blob)

    def no_read(self, *a, **k):
        raise AssertionError("urllib3's read() on a range body")

    monkeypatch.setattr(urllib3.response.HTTPResponse, "read", no_read)
    with CheckpointServer({"org/blob": tmp_path}) as srv:
        client = HttpClient(retry=RetryPolicy(attempts=3, backoff_s=0.01))
        try:
            url = f"{srv.url}/plain/org/blob/blob.bin"
            for off in (0, 4096, 300_000):
                out = bytearray(200_000)
                client.get_range(url, off, memoryview(out))
                assert bytes(out) == blob[off:off + len(out)]
            pool = client._pool.connection_from_url(url)
            assert pool.num_connections == 1  # one keep-alive connection served all three
            srv.faults.append("truncate")
            out = bytearray(300_000)
            client.get_range(url, 1000, memoryview(out))
            assert bytes(out) == blob[1000:1000 + len(out)] and client.stats.retries == 1
        finally:
            client.close()
