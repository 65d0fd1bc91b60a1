"""`moestream info`: a checkpoint's architecture and what it costs in parameters, bytes and reads per token.

Owns the text and JSON presentation; the figures come from moestream.info (headers only, no tensor data).
"""
from __future__ import annotations

import argparse
import json
import sys

from moestream.cli.common import add_budget_arg, model_dir, parse_budget
from moestream.config import format_bytes
from moestream.info import BudgetFit, ModelInfo, model_info


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="sizes, parameters and per-token reads of a checkpoint (headers only)",
                       description="Report a checkpoint's architecture, parameters and bytes from its headers.")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_budget_arg(p, "; also report how many experts this budget can cache")
    p.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    info = model_info(model_dir(args.model), parse_budget(args.ram_budget))
    if args.json:
        print(json.dumps(info.to_json(), indent=2))
    else:
        sys.stdout.write(render(info))
    return 0


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
        f"({i.num_experts * moe} in all, {format_bytes(i.bytes_per_expert)} each)",
        f"parameters:   {human_count(i.total_params)} total, {human_count(i.active_params)} active per token "
        f"({i.total_params} / {i.active_params})",
        f"weights:      {format_bytes(i.total_bytes)} ({i.total_bytes})"
        + ("  [sized from config.json alone: no shards here]" if i.config_only else ""),
        f"dense bytes:  {format_bytes(i.dense_bytes)} ({i.dense_bytes})",
        f"expert bytes: {format_bytes(i.expert_bytes)} ({i.expert_bytes}), paged on demand",
        f"cold read:    {format_bytes(i.expert_bytes_per_token_cold)} of experts per token with an empty cache "
        f"({moe} layers x {i.top_k} experts)",
        f"min budget:   {format_bytes(i.min_ram_budget)} (dense + compute scratch + one expert)",
    ]
    if i.budget is not None:
        lines.append(_budget_line(i.budget))
    return "\n".join(lines) + "\n"


def _budget_line(b: BudgetFit) -> str:
    if not b.fits:
        return (f"budget:       {format_bytes(b.ram_budget)} is too small: the engine needs at least "
                f"{format_bytes(b.min_ram_budget)} ({b.min_ram_budget} bytes)")
    return (f"budget:       {format_bytes(b.ram_budget)} leaves {format_bytes(b.cache_bytes)} for the expert cache: "
            f"{b.experts_fit} of {b.experts_total} experts fit ({100 * b.fraction:.1f}%); "
            f"the KV cache grows into the same space")
