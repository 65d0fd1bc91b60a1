"""`moestream info`: a checkpoint's architecture and what it costs in parameters, bytes and reads per token.

Owns the text and JSON presentation; the figures come from moestream.info (headers only, no tensor data).
"""
from __future__ import annotations

import argparse
import json
import sys

from moestream.cli.common import add_budget_arg, add_remote_args, model_dir, parse_budget
from moestream.config import format_bytes
from moestream.engine.residency import ResidencyPlan
from moestream.info import BudgetFit, ModelInfo, model_info


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="sizes, parameters and per-token reads of a checkpoint (headers only)",
                       description="Report a checkpoint's architecture, parameters and bytes from its headers.")
    p.add_argument("model", help="checkpoint directory, hf://ORG/NAME[@REV] or https://.../DIR/")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_remote_args(p)
    add_budget_arg(p, "; also print the residency plan (which dense layers stay resident, which stream) and how "
                      "many experts the rest can cache")
    p.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    path = model_dir(args.model, full=False)  # a remote model: config, index json and headers only
    info = model_info(path, parse_budget(args.ram_budget))
    source = remote_source(path)
    if args.json:
        print(json.dumps({**info.to_json(), **source}, indent=2))
    else:
        sys.stdout.write(render(info))
        if source:
            rev = source["revision"] or "not versioned (ETags pinned)"
            print(f"source:       {source['source']} (revision {rev}; local stub above)")
    return 0


def remote_source(path) -> dict:
    """{"source", "revision"} of a remote checkpoint's stub directory; {} for a local checkpoint."""
    from moestream.weights.remote import manifest_of

    m = manifest_of(path)
    return {"source": m["source"], "revision": m.get("revision")} if m else {}


def human_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def render(i: ModelInfo) -> str:
    moe = len(i.moe_layers)
    lines = [
        f"model:        {i.path}",
        f"architecture: {i.model_type}, {i.num_layers} layers ({moe} MoE), hidden {i.hidden_size}",
        f"experts:      {i.num_experts} routed per MoE layer, top-{i.top_k} per token "
        f"({i.num_experts * moe} in all, {format_bytes(i.bytes_per_expert)} each"
        + (f", {i.expert_codec}-coded" if i.expert_codec else "") + ")",
        f"parameters:   {human_count(i.total_params)} total, {human_count(i.active_params)} active per token "
        f"({i.total_params} / {i.active_params})",
        f"weights:      {format_bytes(i.total_bytes)} ({i.total_bytes})"
        + ("  [sized from config.json alone: no shards here]" if i.config_only else ""),
        f"dense bytes:  {format_bytes(i.dense_bytes)} ({i.dense_bytes})"
        + (f", of which {i.dense_coded[0]} b12-coded matrices: {format_bytes(i.dense_coded[1])} "
           f"({format_bytes(i.dense_coded[2])} as bf16)" if i.dense_coded[0] else ""),
        f"expert bytes: {format_bytes(i.expert_bytes)} ({i.expert_bytes}), paged on demand",
        f"cold read:    {format_bytes(i.expert_bytes_per_token_cold)} of experts per token with an empty cache "
        f"({moe} layers x {i.top_k} experts)",
        f"min budget:   {format_bytes(i.min_ram_budget)} ({i.min_ram_budget}) streaming the dense layers; "
        f"{format_bytes(i.all_resident_budget)} keeps every dense weight resident",
    ]
    if i.budget is not None:
        lines.append(_budget_line(i.budget))
        if i.budget.residency is not None:
            lines += _residency_lines(i.budget.residency)
    return "\n".join(lines) + "\n"


def _residency_lines(r: ResidencyPlan) -> list[str]:
    streamed = r.streamed_layers
    n = len(r.layers)
    lines = [f"residency:    {n - len(streamed)} of {n} layers resident ({format_bytes(r.resident_dense_bytes)} "
             f"of {format_bytes(r.dense_bytes)} dense resident)"]
    if streamed:
        lines.append(f"  streamed:   layers {_ranges(streamed)}: {format_bytes(r.streamed_bytes_per_step)} read per "
                     f"step, two layers in RAM at once ({format_bytes(r.layer_buffer_bytes)})")
    if r.embed_streamed:
        lines.append("  embedding:  not resident: the rows of each step's tokens are read from disk")
    if r.head_streamed and r.head_resident_rows:
        lines.append(f"  lm_head:    first {r.head_resident_rows} rows resident "
                     f"({format_bytes(r.head_resident_bytes)}), the rest read in slabs of "
                     f"{format_bytes(r.head_slab_bytes)}, the next in flight "
                     f"({format_bytes(r.head_stream_bytes)} per step)")
    elif r.head_streamed:
        lines.append(f"  lm_head:    not resident: read in slabs of {format_bytes(r.head_slab_bytes)}, the next in "
                     f"flight ({format_bytes(r.head_stream_bytes)} per step)")
    lines.append(f"  kept:       {format_bytes(r.pinned_bytes)} of norms, routers and other small tensors always; "
                 f"expert cache at least {format_bytes(r.min_cache_bytes)}")
    return lines


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x > start else f"{x}")
            start = None
    return ", ".join(out)


def _budget_line(b: BudgetFit) -> str:
    if not b.fits:
        return (f"budget:       {format_bytes(b.ram_budget)} is too small: the engine needs at least "
                f"{format_bytes(b.min_ram_budget)} ({b.min_ram_budget} bytes)")
    return (f"budget:       {format_bytes(b.ram_budget)} leaves {format_bytes(b.cache_bytes)} for the expert cache: "
            f"{b.experts_fit} of {b.experts_total} experts fit ({100 * b.fraction:.1f}%); "
            f"the KV cache grows into the same space")
