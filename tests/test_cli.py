"""The `moestream` command, run as a subprocess on a tiny synthetic checkpoint: info arithmetic, run output and
stats, and the error contract (exit 2, `error: ...`, no traceback)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moestream.synth import synthesize


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    cache = tmp_path_factory.mktemp("xdg")
    return {**os.environ, "XDG_CACHE_HOME": str(cache)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, env) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "qwen3-tiny"
    synthesize("qwen3_moe", path, "tiny", seed=0, cache_dir=Path(env["XDG_CACHE_HOME"]) / "moestream",
               progress=False)
    return path


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moestream", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=300)


def inproc(capsys, *args: str) -> tuple[int, str, str]:
    """The same command in this process (saves a torch import per call; subprocess tests cover the wiring)."""
    from moestream.cli import main

    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _tensor_elements(path: Path) -> tuple[int, int]:
    elements = nbytes = 0
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                n = torch.Size(f.get_slice(name).get_shape()).numel()
                elements, nbytes = elements + n, nbytes + 2 * n  # bf16
    return elements, nbytes


def test_info_json_arithmetic(tiny, env):
    out = cli(env, "info", tiny, "--json", "--ram-budget", "1MB")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    for key in ("model_type", "total_params", "active_params", "dense_bytes", "expert_bytes",
                "expert_bytes_per_token_cold"):
        assert key in info
    elements, nbytes = _tensor_elements(tiny)
    assert info["model_type"] == "qwen3_moe"
    assert info["total_params"] == elements
    assert info["dense_bytes"] + info["expert_bytes"] == nbytes
    moe, k = len(info["moe_layers"]), info["top_k"]
    per_expert = info["expert_bytes"] // (moe * info["num_experts"])
    assert info["bytes_per_expert"] == per_expert == 3 * 64 * 64 * 2  # gate, up, down of 64 x 64 in bf16
    assert info["expert_bytes_per_token_cold"] == moe * k * per_expert
    expert_params = info["expert_params"] // (moe * info["num_experts"])
    assert info["embedding_params"] == 512 * 64  # vocab x hidden: a row lookup, not counted as active
    assert info["active_params"] == info["dense_params"] - info["embedding_params"] + moe * k * expert_params
    b = info["budget"]
    assert b["ram_budget"] == 10**6 and b["fits"]
    assert b["cache_bytes"] == 10**6 - info["dense_bytes"] - info["scratch_bytes"]
    assert per_expert <= b["resident_bytes_per_expert"] < per_expert + 8192  # plus read alignment at most
    assert b["experts_fit"] == int(b["cache_bytes"] // b["resident_bytes_per_expert"])
    assert b["fraction"] == pytest.approx(b["experts_fit"] / (moe * info["num_experts"]))


def test_info_text(tiny, capsys):
    rc, out, err = inproc(capsys, "info", tiny, "--ram-budget", "1MiB")
    assert rc == 0, err
    assert "qwen3_moe" in out and "active per token" in out
    assert re.search(r"\d+ of 64 experts fit", out)
    rc, out, _ = inproc(capsys, "info", tiny, "--ram-budget", "300KB")
    assert rc == 0 and "too small" in out


def test_run_streams_text_and_stats(tiny, env):
    out = cli(env, "run", tiny, "--prompt", "def main():", "--max-new", "12", "--ram-budget", "800KB", "--stats")
    assert out.returncode == 0, out.stderr
    text, stats = out.stdout.split("--- stats ---")
    assert text.strip(), "some text was generated"
    figures = {name: float(m.group(1)) for name, pattern in [
        ("decode", r"decode:\s+([0-9.]+) tokens/s"), ("ttft", r"first token:\s+([0-9.]+) s"),
        ("prefill", r"prefill:\s+([0-9.]+) tokens/s"), ("hit", r"hit rate:\s+([0-9.]+)% in decode"),
        ("bytes", r"\(([0-9]+) bytes\) per generated token"),
    ] if (m := re.search(pattern, stats))}
    assert set(figures) == {"decode", "ttft", "prefill", "hit", "bytes"}, stats
    assert figures["decode"] > 0 and figures["ttft"] > 0 and figures["prefill"] > 0
    assert 0 < figures["bytes"] <= 4 * 2 * (24576 + 8192)  # a cold read: 4 layers x top-2 x 24 KiB (+ alignment)
    peak, budget = map(int, re.search(r"\((\d+) of (\d+) bytes", stats).groups())
    assert budget == 800_000 and 0 < peak <= budget


def test_no_budget_is_no_limit_only_where_the_model_fits(tiny, capsys, monkeypatch):
    """Without --ram-budget, run takes no limit while every weight fits in 75% of the memory available, and a
    budget of that share (said on stderr) where it does not: an unlimited cache would grow until the kernel
    killed the process."""
    import moestream.cgroup

    args = ("run", tiny, "--prompt", "def main():", "--max-new", "4", "--stats")
    monkeypatch.setattr(moestream.cgroup, "memory_available", lambda: 1 << 40)
    rc, out, err = inproc(capsys, *args)
    assert rc == 0, err
    assert "no --ram-budget set" in out and "note:" not in err
    rc, out, err = inproc(capsys, *args, "--state-room", "1MB")  # no budget for it to be part of: said, not an error
    assert rc == 0 and "--state-room 1MB does nothing without a budget" in err
    room = 1_400_000  # 75% of it, 1,050,000 bytes: above the tiny model's minimum, below all of its weights
    monkeypatch.setattr(moestream.cgroup, "memory_available", lambda: room)
    rc, out, err = inproc(capsys, *args)
    assert rc == 0, err
    assert "no --ram-budget" in err and "using 1.00 MiB (75% of it)" in err, err
    peak, budget = map(int, re.search(r"\((\d+) of (\d+) bytes", out).groups())
    assert budget == int(0.75 * room) and 0 < peak <= budget
    monkeypatch.setattr(moestream.cgroup, "memory_available", lambda: 400_000)  # a share too small to run in
    rc, _, err = inproc(capsys, *args)
    assert rc == 2 and "needs at least" in err and "available" in err and "Traceback" not in err


def test_commands_share_option_names(tiny, capsys, tmp_path):
    """The token count is --max-new or --max-new-tokens in run, demo and trace alike; run and trace take
    --threads as serve, batch and bench do; a thread count below 1 is refused by every one of them."""
    import torch

    from moestream.kernels import cpu

    before, native = torch.get_num_threads(), cpu.threads()
    try:
        a = inproc(capsys, "run", tiny, "--prompt", "hi", "--max-new", "5")
        b = inproc(capsys, "run", tiny, "--prompt", "hi", "--max-new-tokens", "5", "--threads", "1")
        assert a[0] == b[0] == 0 and a[1] == b[1] and a[1].strip()  # greedy: the same text
        assert torch.get_num_threads() == 1
        prompts = tmp_path / "p.txt"
        prompts.write_text("one\ntwo\n")
        rc, out, err = inproc(capsys, "trace", tiny, "--prompts", prompts, "--max-new", "2", "--threads", "1", "--json")
        assert rc == 0, err
        assert json.loads(out)
    finally:
        torch.set_num_threads(before)
        if native:
            cpu.set_threads(native)
    for cmd in (["run", tiny, "--prompt", "hi"], ["serve", tiny], ["bench", tiny], ["trace", tiny, "--prompts", "x"],
                ["batch", tiny, "in.jsonl", "-o", "out.jsonl"]):
        with pytest.raises(SystemExit) as e:
            inproc(capsys, *cmd, "--threads", "0")
        assert e.value.code == 2 and "--threads: must be at least 1" in capsys.readouterr().err


def test_run_chat_sampling_is_seeded(tiny, capsys):
    args = ("run", tiny, "--prompt", "hello", "--chat", "--max-new", "8", "--temperature", "0.8",
            "--top-p", "0.9", "--top-k", "50", "--seed", "3")
    a, b = inproc(capsys, *args), inproc(capsys, *args)
    assert a[0] == 0, a[2]
    assert a[1] == b[1] and a[1].strip()


def test_unknown_model_type(tiny, env, tmp_path):
    for shard in tiny.glob("*.safetensors*"):
        (tmp_path / shard.name).symlink_to(shard)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = cli(env, "run", tmp_path, "--prompt", "hi")
    assert out.returncode == 2
    assert out.stderr.startswith("error:") and "Traceback" not in out.stderr
    assert "llama" in out.stderr and "qwen3_moe" in out.stderr and "mixtral" in out.stderr


def test_budget_too_small_names_both_numbers(tiny, env):
    out = cli(env, "run", tiny, "--prompt", "hi", "--ram-budget", "100000")
    assert out.returncode == 2 and out.stderr.startswith("error:") and "Traceback" not in out.stderr
    from moestream.info import model_info

    assert str(model_info(tiny).dense_bytes) in out.stderr and "100000" in out.stderr


def test_bad_budget_string(tiny, env, capsys):
    out = cli(env, "info", tiny, "--ram-budget", "4XB")
    assert out.returncode == 2 and out.stderr.startswith("error:") and "Traceback" not in out.stderr
    for bad in ("lots", "-1GB", "0", "1.5.2G"):
        rc, _, err = inproc(capsys, "info", tiny, f"--ram-budget={bad}")
        assert rc == 2 and err.startswith("error:"), bad


def test_missing_dir_and_synth_errors(tmp_path, capsys):
    rc, _, err = inproc(capsys, "run", tmp_path / "nope", "--prompt", "hi")
    assert rc == 2 and err.startswith("error:")
    rc, _, err = inproc(capsys, "synth", "llama", tmp_path / "x")
    assert rc == 2 and "qwen3_moe" in err


def test_synth_then_demo_on_it(env, tmp_path):
    out = cli(env, "synth", "mixtral", tmp_path / "m", "--preset", "tiny", "--seed", "1")
    assert out.returncode == 0, out.stderr
    assert "4 shards" in out.stdout
    out = cli(env, "demo", "--synthetic", "mixtral", "--dir", tmp_path / "m", "--max-new", "6")
    assert out.returncode == 0, out.stderr
    assert "random-weight model: its text is noise; the stats are what matter" in out.stdout
    assert "tokens/s" in out.stdout and "prompt:" in out.stdout


def test_default_demo_runs_the_shipped_trained_model(env):
    out = cli(env, "demo", "--max-new", "8")
    assert out.returncode == 0, out.stderr
    assert "Kimi K3 architecture" in out.stdout and "def fibonacci(n):" in out.stdout
    peak, budget = map(int, re.search(r"\((\d+) of (\d+) bytes", out.stdout).groups())
    assert 0 < peak <= budget
    assert re.search(r"cold-cache minimum \(moestream info\): .* \((\d+) bytes\)", out.stdout)
    assert "noise" not in out.stdout


def test_keyboard_interrupt_exits_130(monkeypatch, capsys):
    from moestream import cli as cli_mod
    from moestream.cli import info

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(info, "cmd_info", interrupted)
    assert cli_mod.main(["info", "whatever"]) == 130
    assert "Traceback" not in capsys.readouterr().err
