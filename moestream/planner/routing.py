"""`moestream plan --skew-from model`: the routing skew of a checkpoint whose weights are local, measured by a short
trace of its own router.

Owns feeding random token ids (as `moestream bench` prompts are) through the engine under a small budget and
recording each MoE layer's expert ids (trace.Recorder), turned into a Skew by skew.from_routing. A prefill chunk
routes every token, so no decode step is needed; the prompt's consecutive tokens give the next-token reuse.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moestream.planner.skew import routing_report

TRACE_TOKENS = 512  # tokens a --skew-from model trace routes (per-expert counts of ~64 at 64 experts, top-8)
TRACE_BUDGET = 2 << 30  # the trace's RAM budget where the engine can open under it (the experts are read anyway)


def trace_model(path: str | Path, tokens: int = TRACE_TOKENS, seed: int = 1, budget: int | None = None) -> dict:
    """Prefill `tokens` random token ids (seed `seed`) through the checkpoint at `path`, recording every MoE
    layer's routing; its routing report (skew.routing_report, with its `source`; skew.from_report reads it)."""
    from moestream import Engine
    from moestream.info import info_from_plan
    from moestream.planner.facts import open_plan
    from moestream.trace import Recorder

    if budget is None:
        p = open_plan(path)
        try:
            need = info_from_plan(path, p).min_ram_budget
        finally:
            p.store.close()
        budget = max(TRACE_BUDGET, int(need * 1.1))
    eng = Engine.open(path, ram_budget=budget)
    try:
        layout = eng.plan.layout
        if not layout.moe_layers:
            raise ValueError(f"{path} has no routed experts to trace")
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, eng.vocab_size, (max(2, tokens),), generator=gen).tolist()
        rec = Recorder(eng.runner)
        try:
            state = eng.new_sequence()
            eng.prefill(state, ids)
            eng.free(state)
            routed = rec.take(list(layout.moe_layers))  # [tokens, layers, k]
        finally:
            rec.close()
    finally:
        eng.close()
    report = routing_report([routed.tolist()], layout.num_experts, layout.top_k)
    report["source"] = f"measured: a trace of {path}'s own router over {len(ids)} random token ids"
    return report
