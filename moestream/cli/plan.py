"""`moestream plan MODEL`: predicted speed, TTFT, sequences and cost before any download.

Owns the options, their parsing into `PlanOptions` and the text / JSON presentation of moestream/planner's result;
a remote checkpoint is resolved to its header stub as `info` does (config, index and shard headers only).
"""
from __future__ import annotations

import argparse
import json
import sys

from moestream.cli.common import add_budget_arg, add_remote_args, model_dir, parse_budget
from moestream.config import COMPUTE_DTYPE_NAMES, DEFAULT_BUDGET_SHARE, KV_DTYPE_NAMES, format_bytes, parse_bytes
from moestream.errors import MoestreamError
from moestream.planner.plan import DEFAULT_SKEW, MACHINES, PlanOptions, make_plan
from moestream.planner.skew import Skew


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict decode / prefill / batch speed, TTFT and cost before any download",
                       description="Predict what a checkpoint does on this machine (or a reference machine) from "
                                   "config.json and safetensors headers alone, calibrated by a few seconds of "
                                   "probes (cached per CPU and disk). Every assumption is printed.")
    p.add_argument("model", help="checkpoint directory (for Kimi K3 a directory holding only config.json is enough), "
                                 "hf://ORG/NAME[@REV] or https://.../DIR/")
    add_budget_arg(p, f"; default: {DEFAULT_BUDGET_SHARE * 100:.0f}%% of the memory available here")
    p.add_argument("--batch", type=int, default=None, metavar="N", help="also predict N sequences decoding together")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--gen-len", type=int, default=256, help="generated tokens per sequence (default 256)")
    p.add_argument("--disk-bandwidth", default="auto", metavar="auto|BYTES/s",
                   help="disk read bandwidth, e.g. 7GB (per second), or auto: probe it (cached; default)")
    p.add_argument("--stream-bandwidth", default="auto", metavar="auto|BYTES/s",
                   help="read bandwidth of streamed dense weights (layers, lm_head slabs), or auto: probe it (cached; "
                        "default; with --disk-bandwidth given: that rate)")
    p.add_argument("--skew", type=float, default=None, metavar="S",
                   help=f"expert popularity exponent: rank-i expert weight i^-S; 0 = uniform; default "
                        f"{DEFAULT_SKEW.exponent:g}, fitted to the trained demo model (random-weight synthetic "
                        f"checkpoints: 0.64, docs/plan.md)")
    p.add_argument("--reuse", type=float, default=None, metavar="R",
                   help=f"P(an expert routed for a token is routed again for the next), `moestream trace`'s "
                        f"P(reuse next); default {DEFAULT_SKEW.reuse:g}, the trained demo model's")
    p.add_argument("--skew-from", default=None, metavar="TRACE|model",
                   help="routing measured from the model itself instead of --skew: a `moestream trace --save` file "
                        "or `trace --json` report, or `model`: prefill random token ids through the local weights "
                        "and record the router (a few seconds to minutes: it reads the experts)")
    p.add_argument("--skew-tokens", type=int, default=0, metavar="N",
                   help="tokens the --skew-from model trace routes, split over 8 independent prompts "
                        "(default 768: planner/routing.py)")
    p.add_argument("--save-skew", default=None, metavar="FILE",
                   help="with --skew-from model: also write the trace's routing report to FILE (a later "
                        "--skew-from FILE reads it without tracing again)")
    p.add_argument("--kv-dtype", choices=sorted(KV_DTYPE_NAMES), default="fp32",
                   help="KV / latent cache storage the engine would run with (--kv-dtype of run / serve): bf16 "
                        "halves those caches, int8 takes about a quarter and int4 about an eighth, so more sequences fit "
                        "(default fp32)")
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPE_NAMES, default="fp32",
                   help="many-row products' precision the engine would run with (--compute-dtype of run / serve / "
                        "batch): bf16 prices batch steps and prompt chunks at the bf16 kernels' probed times "
                        "(default fp32)")
    p.add_argument("--price-per-hour", type=float, default=None, metavar="P", help="machine price: prints cost "
                                                                                   "per million tokens")
    p.add_argument("--machine", choices=sorted(MACHINES), default=None,
                   help="plan for a stated reference machine instead of this one")
    p.add_argument("--reference", action="store_true", help="also print every reference machine's prediction")
    p.add_argument("--recalibrate", "--calibrate", dest="calibrate", action="store_true",
                   help="measure this machine's rates again (else cached per CPU and disk)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_remote_args(p)
    p.set_defaults(func=cmd_plan)


def _rate(value: str, flag: str) -> float | None:
    """A --disk-bandwidth style value in bytes/s (None for auto)."""
    if str(value).lower() == "auto":
        return None
    text = str(value).removesuffix("/s")
    try:
        rate = float(text) if text.replace(".", "", 1).replace("e", "", 1).isdigit() else float(
            parse_bytes(text) or 0)
    except (MoestreamError, ValueError):
        raise MoestreamError(f"{flag} must be auto or bytes per second (e.g. 7GB/s, 1.2e9), got {value!r}") from None
    if rate <= 0:
        raise MoestreamError(f"{flag} must be positive, got {value!r}")
    return rate


def options(args: argparse.Namespace) -> PlanOptions:
    disk = _rate(args.disk_bandwidth, "--disk-bandwidth")
    stream = _rate(args.stream_bandwidth, "--stream-bandwidth")
    skew = DEFAULT_SKEW
    if args.skew_from and args.skew is not None:
        raise MoestreamError("--skew-from measures the skew: give it or --skew, not both")
    if args.save_skew and args.skew_from != "model":
        raise MoestreamError("--save-skew keeps the trace of --skew-from model")
    if args.skew_tokens < 0:
        raise MoestreamError(f"--skew-tokens must be >= 0, got {args.skew_tokens}")
    if args.skew is not None or args.reuse is not None:
        given = " and ".join(n for n, v in (("--skew", args.skew), ("--reuse", args.reuse)) if v is not None)
        skew = Skew(DEFAULT_SKEW.exponent if args.skew is None else args.skew, given,
                    DEFAULT_SKEW.reuse if args.reuse is None else args.reuse)
    return PlanOptions(parse_budget(args.ram_budget), args.batch, args.prompt_len, args.gen_len, disk,
                       args.price_per_hour, skew, args.calibrate, args.machine, args.reference, args.kv_dtype,
                       compute_dtype=args.compute_dtype, skew_from=args.skew_from, skew_tokens=args.skew_tokens,
                       save_skew=args.save_skew, stream_bandwidth=stream,
                       log=lambda msg: print(msg, file=sys.stderr))


def cmd_plan(args: argparse.Namespace) -> int:
    opts = options(args)
    path = model_dir(args.model, full=False)  # a remote model: config, index json and headers only
    out = make_plan(path, opts)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        sys.stdout.write(render(out))
    return 0


def _tps(x: float) -> str:
    return f"{x:.3g} tok/s"


def _machine_lines(r: dict) -> list[str]:
    d = r["decode_step"]
    lines = [
        f"machine:      {r['machine']}",
        f"budget:       {format_bytes(r['ram_budget_bytes'])}: {format_bytes(r['resident_dense_bytes'])} dense "
        f"resident, {format_bytes(r['streamed_dense_bytes_per_step'])} dense streamed per step, expert cache "
        f"{format_bytes(max(0, r['cache_bytes']))} ({r['experts_cached']} of {r['experts_total']} experts)",
        f"decode:       {_tps(r['decode_tokens_per_s'])} (one stream; hit rate {r['expert_hit_rate']:.3f}, "
        f"{format_bytes(r['disk_bytes_per_token'])} read per token; per token io {d['io_s']:.3g} s, compute "
        f"{d['compute_s']:.3g} s, overhead {d['overhead_s']:.3g} s)",
        f"prefill:      {_tps(r['prefill_tokens_per_s'])}, ttft {r['ttft_s']:.3g} s "
        f"(cold cache: {_tps(r['prefill_cold_tokens_per_s'])}, ttft {r['ttft_cold_s']:.3g} s)",
        f"sequences:    {r['max_sequences'] if r['max_sequences'] is not None else 'unbounded'} fit the budget "
        f"({format_bytes(r['state_bytes_per_sequence'])} of state each, {format_bytes(r['state_room_bytes'])} "
        "of room)",
    ]
    if "batch_tokens_per_s" in r:
        b = r["batch_step"]
        lines.append(f"batch:        {_tps(r['batch_tokens_per_s'])} with {r['batch_sequences']} sequences "
                     f"(step {b['seconds']:.3g} s: io {b['io_s']:.3g} s, compute {b['compute_s']:.3g} s, "
                     f"{b['experts_read']:.0f} experts read)")
    if "cost_per_million_tokens" in r:
        cost = f"cost:         {r['cost_per_million_tokens']:.4g} per million tokens (one stream)"
        if "batch_cost_per_million_tokens" in r:
            cost += f", {r['batch_cost_per_million_tokens']:.4g} batched"
        lines.append(cost)
    return lines


def render(out: dict) -> str:
    m = out["model"]
    lines = [f"model:        {m['path']} ({m['model_type']}, {m['layers']} layers, {m['moe_layers']} MoE x "
             f"{m['experts']} experts top-{m['top_k']}, {format_bytes(m['expert_bytes'])} {m['expert_format']} "
             f"each; dense {format_bytes(m['dense_bytes'])})" + ("  [config.json only]" if m["config_only"] else "")]
    lines += _machine_lines(out)
    for ref in out.get("reference_machines", []):
        lines.append("")
        lines += _machine_lines(ref)
    lines += ["", "assumptions:"] + [f"  - {a}" for a in out["assumptions"]]
    return "\n".join(lines) + "\n"
