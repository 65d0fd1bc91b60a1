"""`moestream run`: encode a prompt, stream the generated text, optionally report speed and cache figures.

Owns the CLI side of one generation (prompt encoding, streamed printing through StreamDecoder, timing) and the
stats report that `demo` prints too. Generation itself is `Engine.stream`, the engine's one generation loop.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TextIO

from moestream.cli.common import (DEFAULT_BUDGET_HELP, add_budget_arg, add_compute_dtype_arg, add_remote_args,
                                  add_state_room_arg, add_threads_arg, model_dir, now, open_engine,
                                  resolve_budget)
from moestream.config import format_bytes
from moestream.tokenizer import StreamDecoder, Tokenizer


@dataclass
class Sampling:
    max_new: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class GenerationReport:
    prompt_tokens: int
    new_tokens: int
    decode_steps: int  # forward passes after the prefill
    ttft_s: float  # time to first token: prefill plus the first sample
    decode_s: float
    prefill_bytes: int  # expert bytes read during prefill
    decode_bytes: int
    decode_hits: int
    decode_misses: int
    stats: dict  # Engine.stats at the end


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a prompt",
                       description="Generate text from a prompt, streaming it as it is produced.")
    p.add_argument("model", help="checkpoint directory (config.json, *.safetensors, tokenizer), hf://ORG/NAME[@REV] or "
                        "https://.../DIR/")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    p.add_argument("--max-new", "--max-new-tokens", dest="max_new", type=int, default=128, metavar="N",
                   help="most tokens to generate (128)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (reproducible output)")
    add_remote_args(p)
    add_budget_arg(p, DEFAULT_BUDGET_HELP)
    add_state_room_arg(p)
    add_compute_dtype_arg(p)
    add_threads_arg(p)
    p.add_argument("--stats", action="store_true", help="print speed and expert-cache figures after the text")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    path = model_dir(args.model)
    budget = resolve_budget(args.ram_budget, path, args.state_room)
    engine = open_engine(path, budget, args.state_room, args.kv_dtype, args.compute_dtype, args.threads)
    try:
        tok = Tokenizer.load(path)
        ids = encode_prompt(tok, args.prompt, args.chat)
        sampling = Sampling(args.max_new, args.temperature, args.top_p, args.top_k, args.seed)
        report = stream_text(engine, tok, ids, sampling, sys.stdout)
        if args.stats:
            print_stats(report, sys.stdout)
            print_remote_stats(engine, sys.stdout)
    finally:
        engine.close()
    return 0


def encode_prompt(tok: Tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(text)


def stream_text(engine, tok: Tokenizer, ids: list[int], s: Sampling, out: TextIO) -> GenerationReport:
    """Generate with `engine.stream`, writing text to `out` as it arrives; returns timings and I/O figures."""
    stops = list(dict.fromkeys([*tok.eos_token_ids, *engine.eos_token_ids]))
    decoder = StreamDecoder(tok)
    start, first, n = now(), None, 0
    at_first: dict = {}
    for token in engine.stream(ids, s.max_new, s.temperature, s.top_p, s.top_k, s.seed, stop_token_ids=stops):
        if first is None:
            first, at_first = now(), engine.stats
        n += 1
        _write(out, decoder.push(token))
    end = now()
    _write(out, decoder.flush())
    out.write("\n")
    out.flush()
    return _report(engine.stats, at_first, len(ids), n, s.max_new, start, first, end)


def _write(out: TextIO, piece: str) -> None:
    if piece:
        out.write(piece)
        out.flush()


def _report(final: dict, at_first: dict, n_prompt: int, n: int, max_new: int, start: float,
            first: float | None, end: float) -> GenerationReport:
    # The loop runs no forward after the last token it was allowed; it ran one more if a stop token ended it.
    steps = max(0, n - 1) if n == max_new else n
    if first is None:  # nothing generated: the prefill (if any) is all there was
        first, at_first = end, final
    return GenerationReport(
        n_prompt, n, steps, first - start, end - first, at_first["bytes_read"],
        final["bytes_read"] - at_first["bytes_read"], final["expert_hits"] - at_first["expert_hits"],
        final["expert_misses"] - at_first["expert_misses"], final)


def print_stats(r: GenerationReport, out: TextIO) -> None:
    s = r.stats
    rate = r.decode_steps / r.decode_s if r.decode_s > 0 and r.decode_steps else 0.0
    prefill_rate = r.prompt_tokens / r.ttft_s if r.ttft_s > 0 else 0.0
    decode_lookups = r.decode_hits + r.decode_misses
    lines = [
        "--- stats ---",
        f"decode:          {rate:.2f} tokens/s ({r.new_tokens} tokens generated)",
        f"first token:     {r.ttft_s:.3f} s",
        f"prefill:         {prefill_rate:.1f} tokens/s ({r.prompt_tokens} prompt tokens)",
        f"expert hit rate: {_pct(r.decode_hits, decode_lookups)} in decode, "
        f"{100 * s['expert_hit_rate']:.1f}% overall ({s['expert_evictions']} evictions)",
        f"bytes read:      {_per_token(r)} per generated token (decode); "
        f"{format_bytes(r.prefill_bytes)} in prefill",
        f"peak resident:   {_peak(s)}",
    ]
    out.write("\n".join(lines) + "\n")
    out.flush()


def print_remote_stats(engine, out: TextIO) -> None:
    """Network and SSD-tier figures of a remote checkpoint (nothing for a local one)."""
    stats = getattr(engine.plan.store.index, "stats", None)
    if stats is None:
        return
    s = stats()
    line = (f"network:         {format_bytes(s['http_bytes'])} in {s['http_requests']} requests "
            f"({s['http_retries']} retries, at most {s['http_max_inflight']} in flight)")
    if "disk_hit_bytes" in s:
        line += (f"; disk cache: {format_bytes(s['disk_hit_bytes'])} read, {format_bytes(s['disk_put_bytes'])} "
                 f"written, {s['disk_corrupt_ranges']} corrupt ranges refetched")
    out.write(line + "\n")
    out.flush()


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def _per_token(r: GenerationReport) -> str:
    if not r.decode_steps:
        return "n/a"
    per = r.decode_bytes / r.decode_steps
    return f"{format_bytes(per)} ({per:.0f} bytes)"


def _peak(s: dict) -> str:
    peak, budget = s["peak_resident_bytes"], s["ram_budget_bytes"]
    if budget is None:
        return f"{format_bytes(peak)} ({peak} bytes; no --ram-budget set)"
    return f"{format_bytes(peak)} of the {format_bytes(budget)} budget ({peak} of {budget} bytes, " \
           f"{100 * peak / budget:.0f}%)"
