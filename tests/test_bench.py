"""`moestream bench` on a tiny checkpoint: the JSON report has every field issue #4 names, the numbers are
consistent with each other, the phase breakdown adds up, and the plot is a PNG."""
from __future__ import annotations


import json
import os

import pytest

from moestream.bench import BenchOptions, bench, format_report, probe_disk, probe_stream, model_files
from moestream.cli import main
from moestream.engine.engine import plan

FIELDS = ("decode_tokens_per_s", "prefill_tokens_per_s", "ttft_s", "bytes_read_per_token", "expert_hit_rate",
          "read_bandwidth_bytes_per_s", "disk_bandwidth_bytes_per_s", "io_roofline_fraction", "peak_rss_bytes",
          "ram_budget_bytes")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM

    from conftest import save_reference
    from test_reader import _qwen_config

    path = tmp_path_factory.mktemp("bench_qwen")
    save_reference(Qwen3MoeForCausalLM, _qwen_config(), path)
    return path


def test_report_fields_and_consistency(tiny, tmp_path):
    p = plan(tiny)
    budget = p.dense_bytes + p.scratch_bytes + p.expert_bytes // 4 + 400_000
    png = tmp_path / "run.png"
    r = bench(tiny, BenchOptions(ram_budget=budget, prompt_len=8, gen_len=6, cold=True, temperature=1.0,
                                 threads=1, io_threads=2, plot=png))
    for f in FIELDS:
        assert f in r, f
    assert r["ram_budget_bytes"] == budget and r["gen_len"] == 6 and len(r["per_token"]) == 6
    assert r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 and r["ttft_s"] > 0
    assert 0.0 <= r["expert_hit_rate"] <= 1.0
    assert r["disk_bandwidth_bytes_per_s"] > 0
    probes = r["disk_probes_bytes_per_s"]  # before and after the run, the same time each
    assert len(probes) == 2 and r["disk_bandwidth_bytes_per_s"] == pytest.approx(sum(probes) / 2)
    assert r["disk_bandwidth_best_probe_bytes_per_s"] == max(probes)
    per_tok = 1 / r["decode_tokens_per_s"]
    want = r["bytes_read_per_token"] / r["disk_bandwidth_bytes_per_s"] / per_tok
    assert r["io_roofline_fraction"] == pytest.approx(want)
    best = r["bytes_read_per_token"] / max(probes) / per_tok
    assert r["io_roofline_fraction_best_probe"] == pytest.approx(best)
    assert r["io_roofline_fraction_best_probe"] <= r["io_roofline_fraction"]
    # every byte: expert and streamed dense bytes at the disk's bandwidth, resident bytes at the memory's
    roof = ((r["bytes_read_per_token"] + r["streamed_dense_bytes_per_token"]) / r["disk_bandwidth_bytes_per_s"]
            + r["resident_bytes_per_token"] / r["memory_bandwidth_bytes_per_s"])
    assert r["resident_bytes_per_token"] > 0 and r["every_byte_roofline_fraction"] == pytest.approx(roof / per_tok)
    assert r["every_byte_roofline_fraction"] >= r["io_roofline_fraction"]
    assert 0.0 <= r["disk_busy_fraction"] <= 1.0
    ph = r["decode_phases_s"]
    assert sum(v for v in ph.values()) == pytest.approx(6 * per_tok, rel=1e-6)
    assert ph["attention_mixer_s"] is not None and ph["attention_mixer_s"] > 0
    assert r["peak_accounted_bytes"] <= budget
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode phases" in format_report(r)
    json.dumps(r)  # the report is plain JSON


def test_cli_json(tiny, capsys):
    rc = main(["bench", str(tiny), "--prompt-len", "4", "--gen-len", "2", "--json", "--no-probe", "--threads", "1",
               "--temperature", "1"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ram_budget_bytes"] is None and r["io_roofline_fraction"] is None  # no probe: no roofline
    assert r["every_byte_roofline_fraction"] is None


def test_cli_rejects_bad_policy(tiny, capsys):
    assert main(["bench", str(tiny), "--policy", "fifo", "--no-probe"]) == 2
    assert "unknown --policy" in capsys.readouterr().err


def test_probe_reads_model_files(tiny):
    assert probe_disk(model_files(tiny), threads=2, seconds=0.2, chunk=64 * 1024) > 0


def test_probe_reads_into_several_buffers_and_fails_cleanly(tiny, monkeypatch):
    """The planner's probe reads into several buffers a thread (faulted in before the clock starts); a buffer
    that cannot be mapped is an error out of the probe, not a thread left waiting for the others."""
    import mmap

    files = model_files(tiny)
    assert probe_disk(files, threads=2, seconds=0.2, chunk=64 * 1024, buffers=3) > 0

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(OSError, match="allocate"):
        probe_disk(files, threads=2, seconds=0.2, chunk=64 * 1024, buffers=2)


def test_peak_rss_within_budget_plus_fixed_overhead(tiny):
    """A fresh process (its peak RSS is this run's own): RSS stays within budget + interpreter + the stated
    allowance, under a budget that forces evictions."""
    import subprocess
    import sys

    p = plan(tiny)
    budget = p.dense_bytes + p.scratch_bytes + p.expert_bytes // 4
    out = subprocess.run([sys.executable, "-m", "moestream", "bench", str(tiny), "--ram-budget", str(budget),
                          "--prompt-len", "16", "--gen-len", "8", "--temperature", "1", "--json", "--no-probe",
                          "--threads", "1"], check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    assert r["rss_bound_bytes"] == budget + r["interpreter_rss_bytes"] + (32 << 20)
    assert r["rss_within_bound"], (r["peak_rss_bytes"], r["rss_bound_bytes"])
    assert r["peak_accounted_bytes"] <= budget


def test_stream_probe_reads_a_shards_slabs_back_to_back(tmp_path, monkeypatch):
    """The stream probe (a streamed head's pattern) reads whole slabs of the largest shard; a shard shorter than two
    slabs gives 0.0 (nothing to stream)."""
    from moestream.engine import residency

    monkeypatch.setattr(residency, "HEAD_SLAB_BYTES", 1 << 20)
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(os.urandom(5 << 20))
    small.write_bytes(os.urandom(1 << 20))
    assert probe_stream([small, big], seconds=0.2) > 0
    assert probe_stream([small], seconds=0.2) == 0.0
