"""`moestream batch`: run an OpenAI Batch API request file through a checkpoint, resumably.

Owns the command's options and how its outcome is printed (a progress bar on a terminal, the report as text or
one JSON object). The job itself is moestream/batch/job.py.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from moestream.cli.common import (DEFAULT_BUDGET_HELP, add_budget_arg, add_compute_dtype_arg, add_remote_args,
                                   add_state_room_arg, add_threads_arg, model_dir, resolve_budget)
from moestream.config import parse_bytes
from moestream.errors import MoestreamError
from moestream.weights.remote import is_remote

BUDGETED_MAX_BATCH = 1024  # --max-batch's default under --ram-budget: the budget's state room is the real bound
UNBUDGETED_MAX_BATCH = 64  # ... and without one, where nothing else bounds the sequences' memory
# --prefill-chunk's default (serve's is 256: there, decoding streams wait on prefill). A batch job's steps each read
# the experts they route to, so the fewer steps admit a wave the better: with a cache charged by its pages, the
# 1,024-request job of docs/performance.md ran 80 steps at 4,096 against 96 at 2,048 (1.12x); the scheduler cuts a
# chunk that the budget's room does not hold.
BATCH_PREFILL_CHUNK = 4096

DESCRIPTION = """\
Run every request of INPUT (the OpenAI Batch API format: one JSON object a line with custom_id, method "POST",
url "/v1/chat/completions" or "/v1/completions", and body as `moestream serve` accepts it) and write one line per
request to OUTPUT (id, custom_id, response {status_code, request_id, body}, error). Requests run together through
the server's continuous batching, so greedy results are the ones `serve` gives. Killed at any point, the same
command continues where it stopped; each custom_id ends up in OUTPUT exactly once."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="run a file of OpenAI batch requests (resumable)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="checkpoint directory (config.json, *.safetensors, tokenizer), "
                   "hf://ORG/NAME[@REV] or https://.../DIR/")
    p.add_argument("input", metavar="INPUT.jsonl", help="the requests, one JSON object a line")
    p.add_argument("-o", "--output", required=True, metavar="OUTPUT.jsonl",
                   help="results, appended in fsynced groups; OUTPUT.state beside it records the input's sha256")
    add_budget_arg(p, DEFAULT_BUDGET_HELP)
    add_state_room_arg(p)
    add_compute_dtype_arg(p)
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help=f"sequences decoded together per engine step (default: with --ram-budget {BUDGETED_MAX_BATCH}, "
                        f"admission keeping to what the budget's state room holds; without one {UNBUDGETED_MAX_BATCH})")
    p.add_argument("--prefill-chunk", type=int, default=BATCH_PREFILL_CHUNK, metavar="N",
                   help="prompt tokens prefilled per step across all new sequences (default "
                        f"{BATCH_PREFILL_CHUNK}: each step reads the experts it routes to once, so a batch job "
                        "prefills in large steps)")
    p.add_argument("--prefix-cache", default="0", metavar="BYTES",
                   help="saved prompt state reused by later requests with the same prefix, e.g. 256MiB "
                        "(default 0: off); counted in --ram-budget")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="max_tokens for bodies that set none (default: as serve, the rest of the context)")
    p.add_argument("--model-name", default=None,
                   help="the model id bodies must name in 'model' (default: the directory name, or a remote "
                        "model's spec as typed, as serve)")
    add_threads_arg(p)
    p.add_argument("--sync-every", type=int, default=64, metavar="N",
                   help="results per fsynced group (also at least every 2 s); a kill redoes at most these")
    p.add_argument("--price-per-hour", type=float, default=None, metavar="PRICE",
                   help="what an hour of this machine costs: the report adds the cost per million tokens")
    p.add_argument("--json", action="store_true", help="print the final report as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal anyway)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="spread the job over a Ray cluster (pip install 'moestream[ray]'): ADDRESS of a running "
                        "cluster, or none to start a local one; each worker opens MODEL itself")
    p.add_argument("--ray-workers", type=int, default=None, metavar="N",
                   help="Ray workers, one engine each (default: one per node of the cluster)")
    p.add_argument("--ray-chunk", type=int, default=None, metavar="N",
                   help="requests sent to a worker at a time (default: 4 x --max-batch, at most 512, and small enough that "
                        "every worker gets two chunks of the job)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="each request's results bit-identical whatever requests share its steps (fixed-order "
                        "kernels, prompts cut by their own length), so a seeded temperature > 0 job gives the same "
                        "output locally and on any number of Ray workers (default: on with fp32 compute; it cannot go "
                        "with --compute-dtype bf16)")
    add_remote_args(p)
    p.set_defaults(func=cmd_batch)


def _check(args: argparse.Namespace) -> None:
    for name in ("max_batch", "prefill_chunk", "max_tokens", "sync_every", "ray_workers", "ray_chunk"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise MoestreamError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.price_per_hour is not None and not args.price_per_hour >= 0:
        raise MoestreamError(f"--price-per-hour must be a non-negative number, got {args.price_per_hour}")


def _interrupt(signum, frame) -> None:
    """SIGTERM stops the job like Ctrl-C: finished results still in memory are written before it exits."""
    raise KeyboardInterrupt


def cmd_batch(args: argparse.Namespace) -> int:
    from moestream.batch.job import JobConfig, run_job
    from moestream.batch.report import print_report
    from moestream.batch.runner import BatchOptions

    _check(args)
    path = model_dir(args.model)  # a remote model: its local stub (bodies still name it as typed)
    signal.signal(signal.SIGTERM, _interrupt)
    name = args.model_name or (args.model if is_remote(args.model) else None)
    budget = resolve_budget(args.ram_budget, path, args.state_room)
    max_batch = args.max_batch or (BUDGETED_MAX_BATCH if budget else UNBUDGETED_MAX_BATCH)
    options = BatchOptions(max_batch, args.prefill_chunk, parse_bytes(args.prefix_cache) or 0, args.max_tokens,
                           name)
    cfg = JobConfig(str(path), args.input, args.output, budget, args.state_room, args.threads,
                    options, progress=False if args.no_progress else None, price_per_hour=args.price_per_hour,
                    group_lines=args.sync_every, ray=args.ray, ray_workers=args.ray_workers, ray_chunk=args.ray_chunk,
                    kv_dtype=args.kv_dtype, compute_dtype=args.compute_dtype, batch_invariant=args.batch_invariant)
    report = run_job(cfg)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print_report(report, sys.stdout)
    return 0
