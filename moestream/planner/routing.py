"""`moestream plan --skew-from model`: the routing skew of a checkpoint whose weights are local, measured by a short
trace of its own router.

Owns feeding random token ids (as `moestream bench` prompts are) through the engine under a small budget and
recording each MoE layer's expert ids (trace.Recorder), turned into a Skew by skew.from_routing. A prefill chunk
routes every token, so no decode step is needed; the prompts' consecutive tokens give the next-token reuse. The
tokens are split into several independent prompts: one sequence's tokens share a direction in the residual stream
that favours its own experts, so a single long prompt measures one sequence's skew, while a batch of independent
sequences routes to the union of theirs (q3m_med, 32 tokens a MoE layer: 47 distinct experts by one 512-token
prompt's popularity, 55 by eight 96-token prompts', 58 measured in a batch of 32 sequences).
"""
from __future__ import annotations

from pathlib import Path

import torch

from moestream.planner.skew import routing_report

TRACE_TOKENS = 768  # tokens a --skew-from model trace routes (per-expert counts of ~96 at 64 experts, top-8)
TRACE_PROMPTS = 8  # ... in this many independent prompts (each long enough for a bench window of 64 + 16 tokens)
TRACE_BUDGET = 2 << 30  # the trace's RAM budget where the engine can open under it (the experts are read anyway)


def trace_model(path: str | Path, tokens: int = TRACE_TOKENS, seed: int = 1, budget: int | None = None,
                prompts: int = TRACE_PROMPTS) -> dict:
    """Prefill `tokens` random token ids (seed `seed`) through the checkpoint at `path` as `prompts` independent
    prompts of equal length (each a fresh sequence), recording every MoE layer's routing; its routing report
    (skew.routing_report: popularity pooled over the prompts, reuse and the replayed windows within each; with
    its `source`; skew.from_report reads it)."""
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
        n = max(1, min(prompts, tokens // 2))
        length = max(2, tokens // n)
        routed = []
        for _ in range(n):
            ids = torch.randint(0, eng.vocab_size, (length,), generator=gen).tolist()
            rec = Recorder(eng.runner)
            try:
                state = eng.new_sequence()
                eng.prefill(state, ids)
                eng.free(state)
                routed.append(rec.take(list(layout.moe_layers)).tolist())  # [tokens, layers, k]
            finally:
                rec.close()
    finally:
        eng.close()
    report = routing_report(routed, layout.num_experts, layout.top_k)
    report["source"] = (f"measured: a trace of {path}'s own router over {n} prompts of {length} random token ids")
    return report
