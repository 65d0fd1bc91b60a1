"""`moestream batch --ray` on a real local Ray cluster with two workers: one is killed mid-job (ray.kill), and the
output still holds every custom_id exactly once, with the same greedy results as a run in this process; and a
seeded temperature-1 job gives outputs identical to the local run (batch invariance, on with --ray)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from moestream.batch import BatchOptions, JobConfig, requests_from, run_batch, run_job  # noqa: E402
from moestream.batch.distributed import WORKER_PREFIX  # noqa: E402
from moestream.engine.engine import Engine  # noqa: E402
from conftest import synth_tiny  # noqa: E402
from moestream.tokenizer import Tokenizer  # noqa: E402

from test_batch import count_lines, essence, read_jsonl, requests, write_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth_tiny(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_worker_killed_mid_job_loses_nothing(model, cluster, tmp_path):
    reqs = requests(model.name, 16, max_tokens=8, logprobs=False)
    inp = write_jsonl(tmp_path / "in.jsonl", reqs)
    out = tmp_path / "out.jsonl"
    cfg = JobConfig(str(model), str(inp), str(out), threads=1, options=BatchOptions(max_batch=2), progress=False,
                    group_lines=1, ray="", ray_workers=2, ray_chunk=2)
    got: dict = {}
    job = threading.Thread(target=lambda: got.update(report=run_job(cfg)), daemon=True)
    job.start()
    deadline = time.time() + 240
    while count_lines(out) < 2:  # the first chunk is written: both workers are busy
        assert job.is_alive() and time.time() < deadline, "the job ended before a worker could be killed"
        time.sleep(0.05)
    ray.kill(ray.get_actor(f"{WORKER_PREFIX}-1"))
    job.join(timeout=240)
    report = got["report"]
    assert report.workers == 2 and report.reassigned >= 1 and report.failed == 0
    results = read_jsonl(out)
    ids = [r["custom_id"] for r in results]
    assert sorted(ids) == sorted(r["custom_id"] for r in reqs) and len(set(ids)) == len(ids)  # exactly once

    torch.set_num_threads(1)
    engine = Engine.open(model)
    try:
        want = run_batch(engine, Tokenizer.load(model), requests_from(reqs), BatchOptions(max_batch=2)).results
    finally:
        engine.close()
    assert {r["custom_id"]: essence(r["response"]["body"]) for r in results} == \
        {r["custom_id"]: essence(r["response"]["body"]) for r in want}


def test_default_chunk_spreads_a_job_over_the_workers():
    from moestream.batch.distributed import CHUNKS_PER_WORKER, RAY_CHUNK_MAX, default_chunk

    assert default_chunk(2048, 2, 256) * 2 * CHUNKS_PER_WORKER >= 256 > default_chunk(2048, 2, 256) * 2
    assert default_chunk(2048, 2, 10 ** 6) == RAY_CHUNK_MAX and default_chunk(8, 2, 10 ** 6) == 16
    assert default_chunk(2048, 4, 3) == 1 and default_chunk(64, 2, None) == 128


def test_sampled_job_on_two_workers_matches_the_local_run(model, cluster, tmp_path):
    """Issue #11: a seeded temperature-1 job on two Ray workers gives outputs identical to the same job run in this
    process. Each worker batches its own chunks' requests together, so every request shares its steps with other
    requests (and other numbers of them) than locally; batch invariance (moestream batch's default) makes that moot."""
    import random

    rng = random.Random(5)
    words = ["tea", "moon", "river", "stone", "cloud", "lamp", "fox", "salt"]
    reqs = [{"custom_id": f"s{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model.name, "prompt": " ".join(rng.choices(words, k=rng.randrange(2, 40))),
                      "max_tokens": 24, "temperature": 1.0, "seed": 500 + i, "logprobs": 1}} for i in range(64)]
    inp = write_jsonl(tmp_path / "in.jsonl", reqs)
    opts = BatchOptions(max_batch=32, prefill_chunk=64)
    local = JobConfig(str(model), str(inp), str(tmp_path / "local.jsonl"), threads=1, options=opts, progress=False)
    assert local.invariant()  # moestream batch's default with fp32 compute
    run_job(local)
    remote = JobConfig(str(model), str(inp), str(tmp_path / "ray.jsonl"), threads=1, options=opts, progress=False,
                       ray="", ray_workers=2)
    assert remote.invariant()
    report = run_job(remote)
    assert report.workers == 2 and report.failed == 0
    def exact(body: dict) -> tuple:  # the tokens, and their logprobs to the last bit (a short job on the tiny model
        # rarely flips a sampled token, but a logit moved by other rows moves its logprob)
        return essence(body), [c["logprobs"]["token_logprobs"] for c in body["choices"]]

    want = {r["custom_id"]: exact(r["response"]["body"]) for r in read_jsonl(tmp_path / "local.jsonl")}
    got = read_jsonl(tmp_path / "ray.jsonl")
    assert len(got) == len(want) == 64
    assert {r["custom_id"]: exact(r["response"]["body"]) for r in got} == want
