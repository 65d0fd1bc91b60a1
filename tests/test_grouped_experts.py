"""Resident MXFP4 experts computed by one grouped decode give what the per-expert kernel gives."""
from __future__ import annotations

import torch

from moestream import Engine
from moestream.models.latent_moe import LatentMoE
from moestream.synth import synthesize


def _logits(path, ids, grouped: bool):
    eng = Engine.open(path)  # no budget: every expert stays resident, so steps after the first are all hits
    for layer in eng.model.layers:
        if isinstance(layer.ffn, LatentMoE) and not grouped:
            layer.ffn.group = None
    calls = []
    real_run = eng.runner.run

    def spy(*a, **kw):
        calls.append(kw.get("group") is not None)
        return real_run(*a, **kw)

    eng.runner.run = spy
    out = eng.logits(ids)
    return out, eng.logits(ids), any(calls)


def test_grouped_mxfp4_experts_match_per_expert(tmp_path):
    synthesize("kimi_k3", tmp_path / "k3", "tiny")
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    cold_g, warm_g, used_group = _logits(tmp_path / "k3", ids, grouped=True)
    cold_p, warm_p, used_plain = _logits(tmp_path / "k3", ids, grouped=False)
    assert used_group and not used_plain
    for a, b in ((cold_g, cold_p), (warm_g, warm_p), (warm_g, cold_g)):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
