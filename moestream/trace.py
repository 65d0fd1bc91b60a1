"""Routing statistics (`moestream trace MODEL --prompts FILE`): which experts each token uses, and what it implies.

Owns recording a routing trace through a running engine (per prompt, per token, per MoE layer: the expert ids),
the statistics drawn from it (usage skew per layer, probability an expert is reused by the next token) and a
replay of the trace through the engine's own cache policies at several cache sizes, next to the offline
optimum. It never changes routing or weights: the recorder only wraps the runner of one engine instance.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moestream.errors import MoestreamError

Key = tuple[int, int]  # (layer, expert)


@dataclass
class Trace:
    """prompts[i] is [tokens, len(layers), top_k] expert ids in token order (prompt tokens, then generated)."""

    layers: list[int]
    num_experts: int
    top_k: int
    prompts: list[torch.Tensor] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # the token ids fed, per prompt

    @property
    def num_tokens(self) -> int:
        return sum(p.shape[0] for p in self.prompts)

    def accesses(self, prompts: list[int] | None = None) -> list[list[Key]]:
        """Decode order: token by token, MoE layer by layer; each entry is one layer step's k experts."""
        out = []
        for i in prompts if prompts is not None else range(len(self.prompts)):
            for row in self.prompts[i].tolist():
                out.extend([(layer, e) for e in experts] for layer, experts in zip(self.layers, row))
        return out


# ---- recording ------------------------------------------------------------------------------------------------
class Recorder:
    """Wraps one ExpertRunner's `run` (on the instance only) to log (layer, ids) before each MoE layer step."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.calls: list[tuple[int, torch.Tensor]] = []
        self._inner = runner.run

        def run(layer, x, ids, *args, **kwargs):
            self.calls.append((layer, ids.detach().clone()))
            return self._inner(layer, x, ids, *args, **kwargs)

        runner.run = run

    def take(self, layers: list[int]) -> torch.Tensor:
        """The calls since the last take as [tokens, len(layers), k] (steps concatenated per layer)."""
        per = {layer: [ids for l_, ids in self.calls if l_ == layer] for layer in layers}
        self.calls = []
        return torch.stack([torch.cat(per[layer]) for layer in layers], dim=1)

    def close(self) -> None:
        self.runner.run = self._inner


def record(engine, prompts: list[list[int]], max_new_tokens: int = 32) -> Trace:
    """Run each prompt (prefill + greedy decode) through `engine`, logging the routing of every token fed."""
    layout = engine.plan.layout
    if max_new_tokens < 1:
        raise MoestreamError("tracing needs --max-new-tokens of at least 1 (the prompt is traced as it is fed)")
    if not layout.moe_layers:
        raise MoestreamError("this model has no routed experts to trace")
    trace = Trace(list(layout.moe_layers), layout.num_experts, layout.top_k)
    rec = Recorder(engine.runner)
    try:
        for ids in prompts:
            out = list(engine.stream(ids, max_new_tokens, stop_token_ids=[]))
            trace.prompts.append(rec.take(trace.layers))
            trace.tokens.append(list(ids) + out[:-1] if out else list(ids))
    finally:
        rec.close()
    return trace


# ---- statistics -----------------------------------------------------------------------------------------------
def usage(trace: Trace) -> list[dict]:
    """Per MoE layer: how unevenly the routings spread over the experts."""
    rows = []
    for j, layer in enumerate(trace.layers):
        ids = torch.cat([p[:, j].flatten() for p in trace.prompts])
        counts = torch.bincount(ids, minlength=trace.num_experts).double()
        share = counts / counts.sum()
        top = max(1, trace.num_experts // 10)
        entropy = float(-(share[share > 0] * share[share > 0].log()).sum())
        rows.append({"layer": layer, "used": int((counts > 0).sum()), "max_over_mean": float(counts.max() /
                     counts.mean()), "cv": float(counts.std() / counts.mean()), "top10_share":
                     float(share.sort(descending=True).values[:top].sum()), "effective": math.exp(entropy),
                     # every expert's share, most used first (`moestream plan --skew-from` reads them)
                     "shares": [round(float(x), 6) for x in share.sort(descending=True).values]})
    return rows


def reuse(trace: Trace) -> list[float]:
    """Per MoE layer: P(an expert routed for token t is routed again for token t+1), within each prompt."""
    out = []
    for j in range(len(trace.layers)):
        same = pairs = 0
        for p in trace.prompts:
            a, b = p[:-1, j], p[1:, j]  # [n-1, k]
            same += int((a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum())
            pairs += a.numel()
        out.append(same / pairs if pairs else 0.0)
    return out


# ---- cache replay ---------------------------------------------------------------------------------------------
def replay(accesses: list[list[Key]], capacity: int, policy) -> float:
    """Hit rate of a cache holding `capacity` experts driven by `policy` (insert / touch / remove / victims),
    served like the engine serves a layer step: hits first, then misses, never evicting the step's own experts."""
    resident: set[Key] = set()
    hits = total = 0
    for step in accesses:
        keep = frozenset(step)
        for key in step:
            total += 1
            if key in resident:
                hits += 1
                policy.touch(key)
                continue
            if len(resident) >= capacity:
                victim = next((k for k in policy.victims() if k not in keep), None)
                if victim is None:
                    continue  # the step alone overflows the cache: streamed through, not kept
                resident.discard(victim)
                policy.remove(victim)
            resident.add(key)
            policy.insert(key)
    return hits / max(1, total)


def optimal(accesses: list[list[Key]], capacity: int) -> float:
    """Belady's offline optimum: evict the resident expert needed again furthest in the future."""
    flat = [k for step in accesses for k in step]
    nxt, last = [len(flat)] * len(flat), {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i], last[flat[i]] = last.get(flat[i], len(flat)), i
    resident: dict[Key, int] = {}  # key -> index of its next use
    hits, i = 0, 0
    for step in accesses:
        keep = frozenset(step)
        for key in step:
            if key in resident:
                hits += 1
            elif len(resident) >= capacity:
                victim = max((k for k in resident if k not in keep), key=resident.get, default=None)
                if victim is None:
                    i += 1
                    continue
                del resident[victim]
            resident[key] = nxt[i]
            i += 1
    return hits / max(1, len(flat))


PIN_SHARE = 0.25  # share of the cache the engine pins for `heat` (ExpertRunner.configure_pins)


def policy_table(trace: Trace, sizes: list[int]) -> list[dict]:
    """Hit rates on the second half of the prompts, each policy with the engine's defaults; `heat` learns its
    per-expert heat from the first half (with one prompt, from the same prompt), as the persisted heat of
    earlier runs would give it."""
    from moestream.experts.policies import POLICIES, HeatPolicy

    n = len(trace.prompts)
    learn, test = (list(range(n // 2)), list(range(n // 2, n))) if n > 1 else ([0], [0])
    heat: dict[Key, float] = {}
    for key in (k for step in trace.accesses(learn) for k in step):
        heat[key] = heat.get(key, 0.0) + 1.0
    accesses = trace.accesses(test)
    rows = []
    for size in sizes:
        row = {"experts": size}
        for name in POLICIES:
            pol = POLICIES[name]() if name != "heat" else HeatPolicy(None)
            if isinstance(pol, HeatPolicy):
                pol.heat = dict(heat)
                pol.set_pin_count(int(PIN_SHARE * size))
            row[name] = replay(accesses, size, pol)
        row["optimal"] = optimal(accesses, size)
        rows.append(row)
    return rows


# ---- report ---------------------------------------------------------------------------------------------------
def report(trace: Trace, multiples: list[float], expert_bytes: int | None = None) -> dict:
    active = len(trace.layers) * trace.top_k
    total = len(trace.layers) * trace.num_experts
    sizes = sorted({min(total, max(trace.top_k, int(round(m * active)))) for m in multiples})
    return {"tokens": trace.num_tokens, "prompts": len(trace.prompts), "moe_layers": len(trace.layers),
            "num_experts": trace.num_experts, "top_k": trace.top_k, "random_reuse": trace.top_k / trace.num_experts,
            "usage": usage(trace), "reuse": reuse(trace), "expert_bytes": expert_bytes, "active_per_token": active,
            "all_experts": total, "caches": policy_table(trace, sizes)}


def format_report(r: dict) -> str:
    lines = [f"{r['tokens']} tokens from {r['prompts']} prompts; {r['moe_layers']} MoE layers x "
             f"{r['num_experts']} experts, top-{r['top_k']}",
             "", "layer  used  max/mean    cv  top10%  effective  P(reuse next)",
             ]
    for u, p in zip(r["usage"], r["reuse"]):
        lines.append(f"{u['layer']:>5}  {u['used']:>4}  {u['max_over_mean']:>8.2f}  {u['cv']:>4.2f}  "
                     f"{u['top10_share']:>6.1%}  {u['effective']:>9.1f}  {p:>13.1%}")
    lines.append(f"(a random router would reuse {r['random_reuse']:.1%}; 'effective' = exp(entropy) experts)")
    names = [k for k in r["caches"][0] if k != "experts"] if r["caches"] else []
    lines += ["", "cache hit rate (second half of the prompts; heat learned on the first half)",
              "experts  of all  x active" + ("        MiB" if r["expert_bytes"] else "") +
              "".join(f"{n:>9}" for n in names)]
    for row in r["caches"]:
        size = row["experts"]
        mib = f"  {size * r['expert_bytes'] / 2**20:>9.1f}" if r["expert_bytes"] else ""
        lines.append(f"{size:>7}  {size / r['all_experts']:>6.1%}  {size / r['active_per_token']:>8.1f}{mib}" +
                     "".join(f"{row[n]:>9.1%}" for n in names))
    return "\n".join(lines)


def read_prompts(path: Path) -> list[str]:
    """A .jsonl file (strings or objects with "prompt"), else prompts separated by lines holding only '---'
    (or one prompt per non-empty line when there is no such separator). Backslash-n in one-liners is a newline."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise MoestreamError(f"cannot read prompts file {path}: {e}") from None
    if str(path).endswith(".jsonl"):
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise MoestreamError(f"{path}: malformed JSON line: {e}") from None
        prompts = [i if isinstance(i, str) else i.get("prompt", "") for i in items]
    elif any(line.strip() == "---" for line in text.splitlines()):
        prompts, cur = [], []
        for line in text.splitlines(keepends=True):
            if line.strip() == "---":
                prompts.append("".join(cur))
                cur = []
            else:
                cur.append(line)
        prompts.append("".join(cur))
    else:
        prompts = [line.replace("\\n", "\n") for line in text.splitlines()]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise MoestreamError(f"{path}: no prompts found")
    return prompts


# ---- CLI ------------------------------------------------------------------------------------------------------
def add_trace_parser(subparsers) -> argparse.ArgumentParser:
    from moestream.cli.common import DEFAULT_BUDGET_HELP, add_budget_arg, add_remote_args, add_threads_arg

    p = subparsers.add_parser("trace", help="record expert routing on prompts and report skew, reuse and cache "
                              "hit rates", description="Run prompts through MODEL, record which experts every "
                              "token uses, and report usage skew per layer, next-token expert reuse and the hit "
                              "rate each cache policy would get at several cache sizes.")
    p.add_argument("model", help="checkpoint directory, hf://ORG/NAME[@REV] or https://.../DIR/ ('demo' for the "
                   "built-in demo model)")
    p.add_argument("--prompts", type=Path, required=True, help="prompts file (.jsonl, '---'-separated, or one "
                   "per line)")
    p.add_argument("--max-new-tokens", "--max-new", dest="max_new_tokens", type=int, default=32, metavar="N",
                   help="greedy tokens generated per prompt (32)")
    p.add_argument("--sizes", default="0.5,1,2,4,8", help="cache sizes as multiples of the experts one token "
                   "activates across all layers (default 0.5,1,2,4,8)")
    p.add_argument("--save", type=Path, default=None, help="also write the trace as JSON lines")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_budget_arg(p, DEFAULT_BUDGET_HELP)
    add_threads_arg(p)
    add_remote_args(p)
    p.set_defaults(func=run_trace)
    return p


def run_trace(args: argparse.Namespace) -> int:
    from moestream import Engine
    from moestream.cli.common import resolve_budget
    from moestream.tokenizer import Tokenizer

    path = resolve_model(args.model)
    try:
        multiples = [float(s) for s in str(args.sizes).split(",") if s.strip()]
    except ValueError:
        raise MoestreamError(f"--sizes must be comma-separated numbers, got {args.sizes!r}") from None
    tok = Tokenizer.load(path)
    engine = Engine.open(path, ram_budget=resolve_budget(args.ram_budget, path), threads=args.threads)
    try:
        trace = record(engine, [tok.encode(p) for p in read_prompts(args.prompts)], args.max_new_tokens)
        layout = engine.plan.layout
        nbytes = engine.plan.store.expert_nbytes(layout.moe_layers[0], 0)
    finally:
        engine.close()
    r = report(trace, multiples, nbytes)
    if args.save:
        save_trace(trace, args.save)
    print(json.dumps(r, indent=2) if args.json else format_report(r))
    return 0


def resolve_model(name: str) -> Path:
    """'demo', a checkpoint directory, or a remote spec (its stub, through the CLI's one resolve path)."""
    if name == "demo":
        from moestream.demo_model import path

        return path()
    from moestream.cli.common import model_dir

    return model_dir(name)


def save_trace(trace: Trace, path: Path) -> None:
    """One JSON object per token: prompt index, position, token id, expert ids per MoE layer."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"layers": trace.layers, "num_experts": trace.num_experts, "top_k": trace.top_k}) + "\n")
        for i, (ids, toks) in enumerate(zip(trace.prompts, trace.tokens)):
            for pos, (row, tok) in enumerate(zip(ids.tolist(), toks)):
                f.write(json.dumps({"prompt": i, "pos": pos, "token": tok, "experts": row}) + "\n")
