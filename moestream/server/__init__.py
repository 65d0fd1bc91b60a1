"""The OpenAI-compatible HTTP server (`moestream serve`): CLI glue only; see app.py, scheduler.py, protocol.py.

Exposes `add_serve_parser(subparsers)` and `run_serve(args) -> int` for the CLI. The server needs the `server`
extra (starlette via fastapi, uvicorn, prometheus-client); it is imported lazily so the rest of moestream works
without it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moestream.cli.common import (DEFAULT_BUDGET_HELP, add_budget_arg, add_compute_dtype_arg, add_remote_args,
                                  add_state_room_arg, add_threads_arg, model_dir, resolve_budget)
from moestream.weights.remote import is_remote

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
                              description="Serve MODEL over /v1/chat/completions, /v1/completions, /v1/models, "
                                          "/health and /metrics, with continuous batching.")
    p.add_argument("model", metavar="MODEL", help="checkpoint directory (config.json, *.safetensors, tokenizer), "
                                                  "hf://ORG/NAME[@REV] or https://.../DIR/")
    add_remote_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    add_budget_arg(p, DEFAULT_BUDGET_HELP)
    add_state_room_arg(p)
    add_compute_dtype_arg(p)
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together per step (default 16)")
    p.add_argument("--max-queue", type=int, default=64, help="requests allowed to wait; more get 429 (default 64)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--prefix-cache", default=None,
                   help="bytes of saved conversation state for prefix reuse, e.g. 512MiB; 0 disables "
                        "(default: min(1GiB, budget/8)); counted in --ram-budget")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled per step so running streams keep decoding (default 256)")
    p.add_argument("--max-body", default="8MiB", help="largest request body accepted; larger gets 413")
    p.add_argument("--model-name", default=None, help="model id clients send (default: the directory name)")
    add_threads_arg(p, "; 1 is faster on a busy machine")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request still running after this many seconds gets a 504 and is cancelled (default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may run before they are cancelled (default 30)")
    p.set_defaults(func=run_serve)
    return p


def _check_args(args: argparse.Namespace) -> str | None:
    for name in ("max_batch", "max_queue", "prefill_chunk"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.request_timeout is not None and not args.request_timeout > 0:
        return f"--request-timeout must be a positive number of seconds, got {args.request_timeout}"
    if not args.shutdown_timeout >= 0:
        return f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}"
    if not 0 < args.port < 65536:
        return f"--port must be in 1..65535, got {args.port}"
    return None


def run_serve(args: argparse.Namespace) -> int:
    from moestream.errors import MoestreamError

    problem = _check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        from moestream.server.app import ServerConfig, ServerState
        from moestream.server.shutdown import serve
    except ImportError as e:
        print(f"error: the server needs its extra dependencies ({e.name} is missing): "
              "pip install 'moestream[server]'", file=sys.stderr)
        return 2
    model, name = args.model, args.model_name
    try:
        if is_remote(model):  # served from its local stub; clients still name it by what the user typed
            model, name = str(model_dir(model)), name or model
        budget = resolve_budget(args.ram_budget, Path(model), args.state_room)
        cfg = ServerConfig(model, args.host, args.port, budget, args.max_batch, args.max_queue,
                           args.api_key, args.prefix_cache, args.prefill_chunk, args.max_body, name,
                           threads=args.threads, state_room=args.state_room, kv_dtype=args.kv_dtype,
                           compute_dtype=args.compute_dtype, request_timeout=args.request_timeout,
                           shutdown_timeout=args.shutdown_timeout)
        srv = ServerState.open(cfg)
    except MoestreamError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    print(f"serving {srv.model_id} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve(srv, args.host, args.port, args.shutdown_timeout)  # returns after a drained SIGTERM / SIGINT
    return 0
