"""`moestream batch`: greedy results token-identical to a real `moestream serve` answering the same requests one at a
time (qwen3_moe, kimi_linear, kimi_k3 tiny checkpoints, at a budget that forces evictions); resume after SIGKILL
at several points (a real subprocess), torn lines, bad lines, a changed input, read-only and full output disks.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from moestream.batch import BatchOptions, InputError, JobConfig, OutputError, requests_from, run_batch, run_job
from moestream.cli import main
from moestream.engine.engine import Engine
from moestream.synth import synthesize
from moestream.tokenizer import Tokenizer

from conftest import expert_budget

STATE_ROOM = 512 << 10  # sequence state (KV / KDA / latent caches) of a few tiny sequences, beside the experts
FAMILIES = ["qwen3_moe", "kimi_linear", "kimi_k3"]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores; these tensors are tiny anyway
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch_models")
    out = {}
    for family in FAMILIES:
        out[family] = root / family
        synthesize(family, out[family], "tiny", cache_dir=root / "cache", progress=False)
    return out


def requests(model: str, n: int, max_tokens: int = 6, logprobs: bool = True) -> list[dict]:
    """Chat and completion requests (greedy) of different prompt lengths; some ask for logprobs."""
    out = []
    for i in range(n):
        words = " ".join(["tea", "moon", "river", "stone", "cloud"][: 1 + i % 5]) + f" {i}"
        if i % 2:
            body = {"model": model, "prompt": f"Once upon {words}", "max_tokens": max_tokens, "temperature": 0}
            if logprobs and i % 3 == 1:
                body["logprobs"] = 2
            url = "/v1/completions"
        else:
            body = {"model": model, "messages": [{"role": "user", "content": f"Tell me about {words}"}],
                    "max_tokens": max_tokens, "temperature": 0}
            if logprobs and i % 4 == 0:
                body.update(logprobs=True, top_logprobs=2)
            url = "/v1/chat/completions"
        out.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return out


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def essence(body: dict) -> dict:
    """What must be identical: generated text (so tokens), finish reasons, usage, logprob tokens."""
    choices = []
    for c in body["choices"]:
        lp = c.get("logprobs")
        tokens = None
        if lp is not None:
            tokens = [e["token"] for e in lp["content"]] if "content" in lp else lp["tokens"]
        choices.append((c.get("text", (c.get("message") or {}).get("content")), c["finish_reason"], tokens))
    return {"choices": choices, "usage": body["usage"]}


def budget(path: Path) -> int:
    return expert_budget(path, 0.3) + STATE_ROOM


# ---- token identity with serve --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_matches_serve_one_at_a_time(family, models):
    from test_server import LiveServer

    from moestream.server.app import ServerConfig

    path = models[family]
    reqs = requests(path.name, 6)
    engine = Engine.open(path, ram_budget=budget(path))
    torch.set_num_threads(1)
    try:
        report = run_batch(engine, Tokenizer.load(path), requests_from(reqs), BatchOptions(max_batch=4))
        stats = engine.stats
    finally:
        engine.close()
    assert stats["expert_evictions"] > 0, "the budget was meant to force evictions"
    assert stats["peak_resident_bytes"] <= budget(path)
    assert report.requests == 6 and report.failed == 0 and report.generated_tokens > 0
    got = {line["custom_id"]: line for line in report.results}

    server = LiveServer(ServerConfig(str(path), ram_budget=budget(path), prefix_cache=0, threads=1))
    try:
        for req in reqs:  # one at a time
            r = httpx.post(server.url + req["url"], json=req["body"], timeout=120)
            assert r.status_code == 200, r.text
            line = got[req["custom_id"]]
            assert line["error"] is None and line["response"]["status_code"] == 200
            assert essence(line["response"]["body"]) == essence(r.json()), req["custom_id"]
    finally:
        server.close()


# ---- resume ----------------------------------------------------------------------------------------------------
def _cli(model: Path, inp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moestream", "batch", str(model), str(inp), "-o", str(out), "--threads", "1",
            "--sync-every", "1", "--no-progress", "--json", *extra]


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _kill_after(cmd: list[str], out: Path, lines: int) -> None:
    """Start the job, SIGKILL it once the output has `lines` lines (0: while it is still starting up)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    try:
        while count_lines(out) < lines and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        if lines == 0:
            time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_resume_after_sigkill_at_several_points(models, tmp_path):
    path = models["qwen3_moe"]
    reqs = requests(path.name, 14, max_tokens=10, logprobs=False)
    inp = write_jsonl(tmp_path / "in.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    cmd = _cli(path, inp, out, "--max-batch", "3")
    seen = []
    for lines in (0, 3, 7):
        _kill_after(cmd, out, lines)
        seen.append(count_lines(out))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    final = json.loads(done.stdout)
    results = read_jsonl(out)
    ids = [r["custom_id"] for r in results]
    assert sorted(ids) == sorted(r["custom_id"] for r in reqs) and len(set(ids)) == len(ids)  # exactly once
    assert seen == sorted(seen) and seen[-1] >= 7, seen  # nothing already written was lost
    assert final["skipped"] == seen[-1] and final["requests"] == len(reqs) - seen[-1]  # nothing redone
    # the pieces are the results of one uninterrupted run
    engine = Engine.open(path)
    try:
        want = run_batch(engine, Tokenizer.load(path), requests_from(reqs), BatchOptions(max_batch=3)).results
    finally:
        engine.close()
    want = {r["custom_id"]: essence(r["response"]["body"]) for r in want}
    assert {r["custom_id"]: essence(r["response"]["body"]) for r in results} == want


def test_a_second_job_on_the_same_output_is_refused(models, tmp_path):
    """Two jobs on one output would each write every result (seen by hand: the same command started again while the
    first still ran left each custom_id twice). The second stops with a clear error before it reads or writes
    anything; the lock goes with its holder, so after a SIGKILL the same command continues, each id once."""
    path = models["qwen3_moe"]
    reqs = requests(path.name, 200, max_tokens=16, logprobs=False)
    inp = write_jsonl(tmp_path / "in.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    cmd = _cli(path, inp, out, "--max-batch", "1")
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while count_lines(out) < 2 and first.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert first.poll() is None, "the first job ended before the second started"
        before = out.read_bytes()
        with pytest.raises(OutputError, match="being written by another moestream batch job"):
            run_job(JobConfig(str(path), str(inp), str(out), progress=False))
        assert out.read_bytes()[:len(before)] == before and first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    ids = [r["custom_id"] for r in read_jsonl(out)]
    assert sorted(ids) == sorted(r["custom_id"] for r in reqs) and len(set(ids)) == len(ids)


def test_torn_last_line_is_cut_and_redone(models, tmp_path):
    path = models["qwen3_moe"]
    inp = write_jsonl(tmp_path / "in.jsonl", requests(path.name, 4, max_tokens=2, logprobs=False))
    out = tmp_path / "out.jsonl"
    run_job(JobConfig(str(path), str(inp), str(out), progress=False))
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 25])  # a kill in the middle of writing the last line
    report = run_job(JobConfig(str(path), str(inp), str(out), progress=False))
    assert report.skipped == 3 and report.requests == 1
    assert sorted(r["custom_id"] for r in read_jsonl(out)) == [f"req-{i}" for i in range(4)]
    again = run_job(JobConfig(str(path), str(inp), str(out), progress=False))  # finished: nothing to do
    assert again.requests == 0 and again.skipped == 4 and count_lines(out) == 4


# ---- bad input ------------------------------------------------------------------------------------------------
def test_bad_lines_become_error_lines(models, tmp_path):
    path = models["qwen3_moe"]
    good = requests(path.name, 2, max_tokens=2, logprobs=False)
    body = good[1]["body"]
    lines = [good[0], "{not json", {"custom_id": "dup", "method": "POST", "url": "/v1/completions", "body": body},
             {"method": "POST", "url": "/v1/completions", "body": body}, "[1, 2]", "",
             {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": body},
             {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": body},
             {"custom_id": "hot", "method": "POST", "url": "/v1/completions", "body": {**body, "temperature": 9}},
             {"custom_id": "who", "method": "POST", "url": "/v1/completions", "body": {**body, "model": "gpt-4o"}},
             {"custom_id": "stream", "method": "POST", "url": "/v1/completions", "body": {**body, "stream": True}},
             {"custom_id": "nobody", "method": "POST", "url": "/v1/completions"},
             {"custom_id": "dup", "method": "POST", "url": "/v1/completions", "body": body}, good[1]]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    report = run_job(JobConfig(str(path), str(inp), str(out), progress=False))
    results = read_jsonl(out)
    by_id = {r["custom_id"]: r for r in results if r["custom_id"] is not None}
    nameless = [r["error"]["code"] for r in results if r["custom_id"] is None]
    assert sorted(nameless) == ["invalid_json", "invalid_request", "missing_custom_id"]
    assert by_id["dup"]["error"]["code"] == "duplicate_custom_id" and "lines 3, 13" in by_id["dup"]["error"]["message"]
    assert by_id["get"]["error"]["code"] == "invalid_method" and by_id["emb"]["error"]["code"] == "invalid_url"
    for cid, status, param in (("hot", 400, "temperature"), ("who", 404, "model"), ("stream", 400, "stream"),
                               ("nobody", 400, "body")):
        resp = by_id[cid]["response"]
        assert resp["status_code"] == status and resp["body"]["error"]["param"] == param, cid
    for cid in ("req-0", "req-1"):
        assert by_id[cid]["response"]["status_code"] == 200 and by_id[cid]["error"] is None
    assert len(results) == 12 and report.requests == 12 and report.failed == 10  # "dup" folded into one line


@pytest.mark.parametrize("content, why", [(b"", "empty"), (b"\n  \n", "empty"), (b"PK\x03\x04\0\0\x14binary", "binary"),
                                          (b"\xff\xfe\xfa garbage\n" * 3, "UTF-8"),
                                          (b"id,prompt\n1,hello\n2,world\n", "not a JSONL")])
def test_not_jsonl_is_a_clear_error_before_the_run(content, why, models, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(content)
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(models["qwen3_moe"]), str(inp), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and why in err and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(InputError):
        run_job(JobConfig(str(models["qwen3_moe"]), str(inp), str(out)))


def test_changed_input_and_foreign_output_are_refused(models, tmp_path):
    path = models["qwen3_moe"]
    reqs = requests(path.name, 2, max_tokens=2, logprobs=False)
    inp = write_jsonl(tmp_path / "in.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    run_job(JobConfig(str(path), str(inp), str(out), progress=False))
    before = out.read_bytes()
    write_jsonl(inp, reqs + requests(path.name, 3, max_tokens=2)[2:])
    with pytest.raises(OutputError, match="has changed since this job started"):
        run_job(JobConfig(str(path), str(inp), str(out), progress=False))
    assert out.read_bytes() == before
    other = tmp_path / "other.jsonl"
    other.write_text('{"unrelated": true}\n')
    with pytest.raises(OutputError, match="not this job's output"):
        run_job(JobConfig(str(path), str(inp), str(other), progress=False))


# ---- output disks ---------------------------------------------------------------------------------------------
def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True)


def test_read_only_output_is_a_clear_error(models, tmp_path):
    path = models["qwen3_moe"]
    inp = write_jsonl(tmp_path / "in.jsonl", requests(path.name, 2, max_tokens=2))
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=64k")
    try:
        with pytest.raises(OutputError, match="read-only file system.*nothing was run"):
            run_job(JobConfig(str(path), str(inp), str(ro / "out.jsonl"), progress=False))
    finally:
        _umount(ro)


def test_full_disk_keeps_what_was_written_and_resumes(models, tmp_path):
    path = models["qwen3_moe"]
    reqs = requests(path.name, 40, max_tokens=1, logprobs=False)
    inp = write_jsonl(tmp_path / "in.jsonl", reqs)
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "size=16k")
    out = disk / "out.jsonl"
    try:
        cfg = JobConfig(str(path), str(inp), str(out), progress=False, group_lines=4, group_s=1e9,
                        options=BatchOptions(max_batch=8))
        with pytest.raises(OutputError, match="is full.*run the same command again"):
            run_job(cfg)
        kept = read_jsonl(out)  # every line whole and readable
        assert 0 < len(kept) < len(reqs) and len(kept) % 4 == 0
        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)
        report = run_job(cfg)
        assert report.skipped == len(kept) and report.requests == len(reqs) - len(kept)
        ids = [r["custom_id"] for r in read_jsonl(out)]
        assert sorted(ids) == sorted(r["custom_id"] for r in reqs) and len(set(ids)) == len(ids)
    finally:
        _umount(disk)


def test_waiting_line_stays_short_while_state_bounds_the_batch(models, monkeypatch):
    """With a --max-batch far above what the state room holds, the runner submits only the running requests plus
    a short waiting line (runner.window), so unadmitted requests do not pile up outside the budget; all finish."""
    from moestream.batch import runner
    from moestream.server.scheduler import Scheduler

    path = models["qwen3_moe"]
    seen: list[tuple[int, int]] = []  # (requests submitted and not yet admitted, sequences running) per submit
    submit = Scheduler.submit

    def recording(self, req):
        seen.append((self._queued, len(self.active)))
        return submit(self, req)

    monkeypatch.setattr(Scheduler, "submit", recording)
    engine = Engine.open(path, ram_budget=budget(path))
    try:
        report = run_batch(engine, Tokenizer.load(path), requests_from(requests(path.name, 120, 3, False)),
                           BatchOptions(max_batch=512))
    finally:
        engine.close()
    assert report.requests == 120 and report.failed == 0 and len(seen) == 120
    assert 1 < report.widest_step < 60  # the state room, not --max-batch, bounded the batch
    assert max(q - max(runner.MIN_WAITING, r // 4) for q, r in seen) <= 0
