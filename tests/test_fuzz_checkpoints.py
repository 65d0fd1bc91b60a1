"""Fuzzed checkpoints: safetensors headers, config.json, tokenizer files, the shard index and pack manifests of
tiny checkpoints mutated at random (moestream.fuzz), then used through the real code paths. Only MoestreamError
(`error: ...`, exit 2) may come out: never another exception, a crash or a traceback. A bounded number of examples
(bench/fuzz_checkpoints.py runs thousands)."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import synth_tiny
from moestream.errors import MoestreamError
from moestream.fuzz import TARGETS, exercise, mutate
from moestream.pack import pack


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Tiny qwen3_moe (bf16, sharded, BPE tokenizer), its packed copy, and tiny Kimi K3 (MXFP4 experts)."""
    qwen = synth_tiny(tmp_path_factory, "qwen3_moe")
    pack(qwen, qwen.parent / "packed")
    return {"qwen": qwen, "packed": qwen.parent / "packed", "k3": synth_tiny(tmp_path_factory, "kimi-k3")}


def _mutated(src: Path, dst: Path, target: str, seed: int, edits: int) -> list[str]:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    rng = random.Random(seed)
    return [mutate(dst, rng, target) for _ in range(edits)]


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(base=st.sampled_from(["qwen", "packed", "k3"]), target=st.sampled_from(TARGETS),
       seed=st.integers(0, 2**32 - 1), edits=st.integers(1, 3))
def test_mutated_checkpoint_gives_only_clear_errors(bases, tmp_path, base, target, seed, edits):
    what = _mutated(bases[base], tmp_path / "m", target, seed, edits)
    try:
        exercise(tmp_path / "m")
    except MoestreamError:
        pass
    except Exception as e:  # noqa: BLE001 - the finding, with the mutation that caused it
        raise AssertionError(f"{base} {what}: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("seed", range(2))
def test_cli_on_mutated_checkpoints_exits_0_or_2_without_traceback(bases, tmp_path, seed):
    rng = random.Random(seed)
    base = rng.choice(sorted(bases))
    d = tmp_path / "m"
    _mutated(bases[base], d, rng.choice(TARGETS), seed, 2)
    for args in (["info", str(d)], ["run", str(d), "--prompt", "def f(x):", "--max-new", "2"]):
        done = subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode in (0, 2), done.stderr[-2000:]
        assert "Traceback" not in done.stderr, done.stderr[-2000:]
        if done.returncode == 2:
            assert done.stderr.startswith("error:") or "\nerror:" in done.stderr
