"""Resident MXFP4 experts computed by one grouped decode give what the per-expert kernel gives, both for
prefill-sized steps (per-expert rows) and for decode-sized batched steps (all rows through all grouped experts)."""
from __future__ import annotations

import torch

from moestream import Engine
from moestream.models.latent_moe import LatentMoE
from moestream.synth import synthesize


def _run(path, ids, grouped: bool):
    eng = Engine.open(path)  # no budget: every expert stays resident, so later steps are all hits
    for layer in eng.model.layers:
        if isinstance(layer.ffn, LatentMoE) and not grouped:
            layer.ffn.group = None
    calls = []
    real_run = eng.runner.run

    def spy(*a, **kw):
        calls.append(kw.get("group") is not None)
        return real_run(*a, **kw)

    eng.runner.run = spy
    outs = [eng.logits(ids), eng.logits(ids)]  # cold, then warm (grouped when allowed)
    seqs = [eng.new_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):
        eng.step([(s, ids[i * 8:(i + 1) * 8])])
    for t in range(4):  # decode steps of 3 sequences at once: the all-rows path
        outs += eng.step([(s, [ids[t * 3 + i]]) for i, s in enumerate(seqs)])
    return outs, any(calls)


def test_grouped_mxfp4_experts_match_per_expert(tmp_path):
    synthesize("kimi_k3", tmp_path / "k3", "tiny")
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    grouped, used_group = _run(tmp_path / "k3", ids, grouped=True)
    plain, used_plain = _run(tmp_path / "k3", ids, grouped=False)
    assert used_group and not used_plain
    assert len(grouped) == len(plain) == 14
    for a, b in zip(grouped, plain):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
