"""bench/batch_throughput.py's FLOP model per family: MLA (no head_dim), KDA (a per-token state update) and GQA
counted from the checkpoint's own config, and the batch bench runs end to end on a Kimi K3 checkpoint."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moestream import Engine

from conftest import synth_tiny

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def flop_model():
    sys.path.insert(0, str(BENCH))
    try:
        from batch_throughput import FlopModel
    finally:
        sys.path.remove(str(BENCH))
    return FlopModel


def _flops(flop_model, path: Path):
    eng = Engine.open(path)
    try:
        c = json.loads((path / "config.json").read_text())
        return flop_model.of(eng), c.get("text_config", c)
    finally:
        eng.close()


def test_gqa_pairs_are_heads_times_dims(tmp_path_factory, flop_model):
    f, c = _flops(flop_model, synth_tiny(tmp_path_factory, "qwen3_moe"))
    assert f.per_pair == 4 * c["num_attention_heads"] * c["head_dim"] * c["num_hidden_layers"]
    assert f.per_logit_row == 2 * c["hidden_size"] * c["vocab_size"]


@pytest.mark.parametrize("family", ["kimi_k3", "deepseek_v3", "kimi_linear"])
def test_mla_pairs_count_only_softmax_layers(tmp_path_factory, flop_model, family):
    path = synth_tiny(tmp_path_factory, family)
    f, c = _flops(flop_model, path)
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    eng = Engine.open(path)
    try:
        cfg = eng.plan.config
        mla = len(cfg.mla_layers) if hasattr(cfg, "mla_layers") else sum(
            1 for t in getattr(cfg, "layer_types", ["full_attention"] * c["num_hidden_layers"])
            if t == "full_attention")
    finally:
        eng.close()
    assert 0 < mla <= c["num_hidden_layers"]
    assert f.per_pair == 2 * c["num_attention_heads"] * (qk + c["v_head_dim"]) * mla


def test_batch_bench_runs_on_kimi_k3(tmp_path_factory):
    from moestream.engine.engine import plan

    path = synth_tiny(tmp_path_factory, "kimi_k3")
    p = plan(path)
    # the bench's default budget (dense + scratch + a quarter of the experts) plus room for three sequences' state
    # and bookkeeping, which on a model this small is not small beside its experts
    budget = p.dense_bytes + p.scratch_bytes + p.expert_bytes // 4 + (1 << 20)
    r = subprocess.run([sys.executable, str(BENCH / "batch_throughput.py"), str(path), "--json", "--requests", "3",
                        "--max-batch", "3", "--prompt-len", "6", "--gen-len", "2", "--single-gen-len", "0",
                        "--no-probe", "--budget", str(budget)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["failed"] == 0 and out["generated_tokens"] == 6 and out["total_flops"] > 0
