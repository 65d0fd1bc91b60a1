"""Batch throughput (issue #11, item 3): N requests through the server's continuous-batching Scheduler at one RAM
budget, against one stream's decode on the same budget, with the step roofline measured in the same run.

    python bench/batch_throughput.py /work/synth/q3m_med [--requests 1024] [--prompt-len 64] [--gen-len 64]
        [--budget BYTES] [--max-batch N] [--prefill-chunk T] [--json]

Default budget: dense weights + compute scratch + a quarter of the expert bytes (from `engine.plan`). The run
probes the disk (direct-I/O, before and after) and the matmul rate in the precision the expert path computes in
(fp32: the fused native kernel widens bf16 expert weights to fp32 and multiplies in fp32 at any row count; bf16
with `--compute-dtype bf16`, which multiplies many-row steps' bf16 weights by bf16-rounded activations), then
drives the job, recording per engine step the bytes read and the FLOPs (and in `step_detail` its rows, misses,
the runner's I/O-wait, expert and lookahead seconds, and the process's page faults and kernel CPU seconds).
Roofline per step = max(bytes / disk bandwidth, FLOPs / matmul rate); `roofline_fraction` = their sum over the
run / wall time. The one-stream figure comes from
`moestream bench` in a child process on the same budget (so this process's peak RSS is the batch's own).
By default the requests run as a `moestream batch` job (`run_as_job`: an input JSONL file, the fsynced output file,
the job's own runner and report); `--runner scheduler` submits them straight to the server's Scheduler instead.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import moestream  # noqa: F401  # before torch: its OpenMP runtime's wait policy (moestream/omp.py)
import torch

from moestream.bench import (PROBE_THREADS, RSS_LIBRARY_ALLOWANCE, drop_page_cache, model_files, peak_rss,
                             probe_disk, rss_now)
from moestream.cli.batch import BATCH_PREFILL_CHUNK
from moestream.config import KV_DTYPE_NAMES, format_bytes
from moestream.planner.facts import attention_shapes, kda_shape
from moestream.server.protocol import GenRequest
from moestream.server.scheduler import Scheduler, SchedulerConfig
from moestream.server.tickets import Delta, Done, Failed


# ---- the job ---------------------------------------------------------------------------------------------------
def job_requests(vocab: int, n: int, prompt_len: int, gen_len: int, temperature: float, seed: int) -> list[GenRequest]:
    """`n` random prompts (token ids, seeded), each sampling `gen_len` tokens with its own seed."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (n, prompt_len), generator=gen).tolist()
    return [GenRequest(p, gen_len, temperature, 1.0, seed + i) for i, p in enumerate(prompts)]


def run_scheduler(engine, tokenizer, requests: list[GenRequest], max_batch: int,
                  prefill_chunk: int) -> tuple[list[dict], dict]:
    """Run every request through one Scheduler; returns per request {text, tokens, finish | error} and a report."""
    cfg = SchedulerConfig(max_batch=max_batch, max_queue=len(requests) + 1, prefill_chunk=prefill_chunk)
    sched = Scheduler(engine, tokenizer, cfg).start()

    async def one(req: GenRequest) -> dict:
        ticket = sched.submit(req)
        text = []
        while True:
            ev = await ticket.next()
            if isinstance(ev, Delta):
                text.append(ev.text)
            elif isinstance(ev, Done):
                return {"text": "".join(text), "tokens": ev.usage.completion_tokens, "finish": ev.finish_reason}
            elif isinstance(ev, Failed):
                return {"error": f"{ev.status}: {ev.message}", "tokens": 0}

    async def all_of() -> list[dict]:
        return await asyncio.gather(*(one(r) for r in requests))

    t0 = time.perf_counter()
    try:
        results = asyncio.run(all_of())
    finally:
        sched.stop()
    wall = time.perf_counter() - t0
    first = requests[0]
    return results, {"wall_s": wall, "steps": sched.counters["steps"], "failed": sched.counters["failed"],
                     "sampled_together": sched.counters["sampled_together"],
                     "max_batch": max_batch, "batch_plan": sched.plan_batch(len(first.prompt_ids), first.max_tokens)
                     if hasattr(sched, "plan_batch") else None}


def run_as_job(engine, tokenizer, requests: list[GenRequest], max_batch: int, prefill_chunk: int,
               keep: Path | None = None) -> tuple[list[dict], dict]:
    """The same requests through `moestream batch`'s own job (moestream.batch.run_job): an OpenAI batch input file
    of /v1/completions bodies (token-id prompts, each request's seed), every result written to and fsynced in the
    output file as it finishes, nothing kept in memory. Returns per request, in input order, {text, tokens, finish} or
{error, tokens} (read back from the output file) and a report. `keep`: a directory to leave in.jsonl and
out.jsonl in (e.g. to run the same job again with `moestream batch --ray` and compare)."""
    import tempfile

    from moestream.batch import BatchOptions, JobConfig, run_job
    from moestream.batch.output import state_path

    model = engine.path.resolve().name
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp:
        where = keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        src, out = where / "in.jsonl", where / "out.jsonl"
        for stale in (out, state_path(out)):
            stale.unlink(missing_ok=True)  # a kept job of an earlier run: this one starts afresh
        with src.open("w") as f:
            for i, r in enumerate(requests):
                body = {"model": model, "prompt": r.prompt_ids, "max_tokens": r.max_tokens,
                        "temperature": r.temperature, "top_p": r.top_p, "seed": r.seed}
                f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                    "body": body}) + "\n")
        opts = BatchOptions(max_batch=max_batch, prefill_chunk=prefill_chunk)
        rep = run_job(JobConfig(str(engine.path), str(src), str(out), options=opts, progress=False), engine=engine)
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        results = [_job_result(line) for line in sorted(lines, key=lambda d: int(d["custom_id"][1:]))]
    return results, {"wall_s": rep.wall_s, "steps": rep.steps, "failed": rep.failed, "max_batch": max_batch,
                     "batch_plan": rep.batch_plan, "widest_step": rep.widest_step}


def _job_result(line: dict) -> dict:
    from moestream.batch.report import failed

    if failed(line):
        return {"error": json.dumps(line.get("error") or line.get("response")), "tokens": 0}
    body = line["response"]["body"]
    return {"text": body["choices"][0]["text"], "tokens": body["usage"]["completion_tokens"],
            "finish": body["choices"][0]["finish_reason"]}


RUNNERS = {"job": run_as_job, "scheduler": run_scheduler}


# ---- per-step measurement ----------------------------------------------------------------------------------------
@dataclass
class Step:
    seconds: float
    bytes_read: int
    tokens: int  # rows through the layers
    logit_rows: int
    attn_pairs: int  # sum over segments of queries x keys (causal attention work)
    decode_rows: int  # segments of one token (decoding sequences)
    misses: int = 0  # expert reads the cache counted as misses
    io_wait_s: float = 0.0  # the runner's own clocks over the step: waiting on reads, computing experts, lookahead
    expert_s: float = 0.0
    lookahead_s: float = 0.0
    # the whole process over the step (its I/O threads included): page faults that found no page (fresh memory
    # faulted in; under a scheduler every temporary above the engine's fixed mmap threshold is a fresh mapping,
    # engine/allocator.py) and kernel CPU seconds
    minor_faults: int = 0
    system_s: float = 0.0
    # seconds from the previous step's return to this step's call: the scheduler's own work between steps (sampling,
    # emitting, admission; for a step of more than engine.LOGIT_CHUNK_ROWS sequences also its lm_head, made a chunk at
    # a time as the rows are sampled)
    gap_s: float = 0.0
    fresh_buffer_bytes: int = 0  # expert read buffers mapped afresh rather than recycled (their pages fault in)

    def detail(self) -> dict:
        """The step's entry in the report's `step_detail` (decode_rows 0 for a step with any prompt chunk)."""
        return {"seconds": self.seconds, "bytes_read": self.bytes_read, "rows": self.tokens,
                "decode_rows": self.decode_rows if len_or(self) == self.decode_rows else 0, "misses": self.misses,
                "io_wait_s": self.io_wait_s, "expert_s": self.expert_s, "lookahead_s": self.lookahead_s,
                "minor_faults": self.minor_faults, "system_s": self.system_s, "gap_s": self.gap_s,
                "fresh_buffer_bytes": self.fresh_buffer_bytes}


@dataclass
class StepMeter:
    """Wraps `engine.step` to record each step's time, bytes read and work (the engine computes as before)."""

    engine: object
    steps: list[Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._inner = self.engine.step
        self.engine.step = self._step
        self._last: float | None = None  # when the previous step returned

    def _step(self, items, all_logits: bool = False):
        store, runner = self.engine.plan.store, self.engine.runner
        times, stats = runner.times, runner.cache.stats
        b0, t0, m0 = store.bytes_read, time.perf_counter(), stats.misses
        gap = t0 - self._last if self._last is not None else 0.0
        r0 = (times.io_wait_s, times.expert_s, times.lookahead_s)
        pool = store.reader.pool
        u0, f0 = resource.getrusage(resource.RUSAGE_SELF), pool.mapped_bytes
        lens = [(s.pos, len(t)) for s, t in items if len(t) > 0]
        out = self._inner(items, all_logits)
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        tokens = sum(n for _, n in lens)
        self.steps.append(Step(time.perf_counter() - t0, store.bytes_read - b0, tokens,
                               tokens if all_logits else len(lens), sum(n * (p + n) for p, n in lens),
                               sum(1 for p, n in lens if n == 1 and p > 0), stats.misses - m0,
                               times.io_wait_s - r0[0], times.expert_s - r0[1], times.lookahead_s - r0[2],
                               u1.ru_minflt - u0.ru_minflt, u1.ru_stime - u0.ru_stime, gap,
                               pool.mapped_bytes - f0))
        self._last = time.perf_counter()
        return out

    def close(self) -> None:
        self.engine.step = self._inner


@dataclass
class FlopModel:
    """FLOPs of one step from the checkpoint's shapes: 2 x (dense matmul weights + top_k experts) per token (plus
    KDA's per-token state update), attention scores and values per query-key pair of the softmax layers (GQA or
    MLA, the planner's per-family shapes), the LM head per logit row."""

    per_token: int
    per_pair: int
    per_logit_row: int

    @classmethod
    def of(cls, engine) -> "FlopModel":
        p = engine.plan
        index, cfg, pre = p.store.index, p.config, p.family.prefix
        head = {pre + "lm_head.weight", pre + "model.embed_tokens.weight"}
        dense = sum(_numel(index[n].shape) for n in p.dense_names if len(index[n].shape) == 2 and n not in head)
        expert = sum(_numel(loc.shape) for loc in p.store.locate(p.layout.moe_layers[0], 0)) \
            if p.layout.moe_layers else 0
        routed = p.layout.top_k * expert * len(p.layout.moe_layers)
        layers = int(cfg.num_layers)
        attn = sum(2 * h * (qk + v) for h, qk, v in attention_shapes(cfg, layers))  # q.k and p.v per pair
        kda_layers, kda_heads, kda_dim = kda_shape(cfg, layers)
        kda = 4 * kda_layers * kda_heads * kda_dim * kda_dim  # the recurrent state's read-update-read per token
        lm = next(index[n] for n in (pre + "lm_head.weight", pre + "model.embed_tokens.weight") if n in index)
        return cls(2 * (dense + routed) + kda, attn, 2 * _numel(lm.shape))

    def step(self, s: Step) -> int:
        return s.tokens * self.per_token + s.attn_pairs * self.per_pair + s.logit_rows * self.per_logit_row


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def matmul_rate(dtype: torch.dtype, m: int = 256, k: int = 1024, n: int = 512, seconds: float = 1.0) -> float:
    """FLOP/s of torch.mm [m, k] x [k, n] in `dtype` on this machine's compute threads, best of short bursts."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        for _ in range(8):
            torch.mm(a, b)
        best = max(best, 8 * 2 * m * k * n / (time.perf_counter() - t))
    return best


def roofline(steps: list[Step], flops: FlopModel, disk_bw: float, rate: float) -> dict:
    io = sum(s.bytes_read / disk_bw for s in steps) if disk_bw > 0 else 0.0
    comp = sum(flops.step(s) / rate for s in steps)
    bound = sum(max(s.bytes_read / disk_bw if disk_bw > 0 else 0.0, flops.step(s) / rate) for s in steps)
    io_bound = sum(1 for s in steps if disk_bw > 0 and s.bytes_read / disk_bw > flops.step(s) / rate)
    return {"roofline_s": bound, "io_floor_s": io, "compute_floor_s": comp, "io_bound_steps": io_bound,
            "steps_s": sum(s.seconds for s in steps), "between_steps_s": sum(s.gap_s for s in steps),
            "total_flops": sum(flops.step(s) for s in steps)}


# ---- one stream, for the ratio -----------------------------------------------------------------------------------
def single_stream(model: Path, budget: int, args: argparse.Namespace) -> dict:
    """`moestream bench` on the same budget in a child process (cold page cache, same prompt length)."""
    cmd = [sys.executable, "-m", "moestream", "bench", str(model), "--ram-budget", str(budget), "--cold", "--json",
           "--prompt-len", str(args.prompt_len), "--gen-len", str(args.single_gen_len), "--temperature",
           str(args.temperature), "--seed", str(args.seed), "--no-probe", "--kv-dtype", args.kv_dtype,
           "--compute-dtype", args.compute_dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {k: r[k] for k in ("decode_tokens_per_s", "prefill_tokens_per_s", "bytes_read_per_token",
                              "expert_hit_rate", "peak_rss_bytes")}


# ---- the run -----------------------------------------------------------------------------------------------------
def default_budget(model: Path) -> int:
    from moestream.engine.engine import plan

    p = plan(model)
    return p.dense_bytes + p.scratch_bytes + p.expert_bytes // 4


def measure_batch(args: argparse.Namespace, budget: int) -> dict:
    from moestream import Engine
    from moestream.tokenizer import Tokenizer

    files = model_files(args.model)
    drop_page_cache(files)
    probes = [probe_disk(files, PROBE_THREADS)] if args.probe else []
    base_rss = rss_now()
    before = None
    if args.rss_trace is not None:
        from rss_trace import base  # bench/rss_trace.py, beside this script

        before = base()
    invariant = batch_invariant(args)
    eng = Engine.open(args.model, ram_budget=budget, threads=args.threads, kv_dtype=args.kv_dtype,
                      compute_dtype=args.compute_dtype, batch_invariant=invariant)
    rate = matmul_rate(torch.float32)
    rate_bf16 = matmul_rate(torch.bfloat16)
    tok = Tokenizer.load(args.model)
    reqs = job_requests(eng.vocab_size, args.requests, args.prompt_len, args.gen_len, args.temperature, args.seed)
    meter = StepMeter(eng)
    trace = None
    if args.rss_trace is not None:
        from rss_trace import RssTrace

        trace = RssTrace(eng, args.rss_trace, before=before)
    try:
        extra = {"keep": args.keep} if args.keep is not None else {}
        results, rep = RUNNERS[args.runner](eng, tok, reqs, args.max_batch, args.prefill_chunk, **extra)
        stats = eng.stats
    finally:
        meter.close()
        eng.runner.finish()
        eng.close()
        if trace is not None:
            trace.close("after the last step, engine closed")
    peak = peak_rss()
    if args.probe:
        probes.append(probe_disk(files, PROBE_THREADS, seed=1))
    bw = sum(probes) / len(probes) if probes else 0.0
    return _report(args, budget, rep, results, meter.steps, FlopModel.of(eng), bw, probes, rate, rate_bf16, stats,
                   peak, base_rss)


def batch_invariant(args) -> bool:
    """--batch-invariant as given, else as `moestream batch` decides: on with fp32 compute."""
    return args.compute_dtype == "fp32" if args.batch_invariant is None else args.batch_invariant


def _report(args, budget, rep, results, steps, flops, bw, probes, rate, rate_bf16, stats, peak, base_rss) -> dict:
    gen = sum(r["tokens"] for r in results)
    prompt = sum(args.prompt_len for r in results if "error" not in r)
    wall = rep["wall_s"]
    roof = roofline(steps, flops, bw, rate_bf16 if args.compute_dtype == "bf16" else rate)
    decode = [s for s in steps if s.decode_rows == len_or(s)]
    prefill_s = sum(s.seconds for s in steps if s.decode_rows != len_or(s))
    nbytes = sum(s.bytes_read for s in steps)
    bound = budget + base_rss + RSS_LIBRARY_ALLOWANCE
    return {
        "model": str(args.model), "requests": args.requests, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "temperature": args.temperature, "failed": sum(1 for r in results if "error" in r),
        "errors": sorted({r["error"] for r in results if "error" in r})[:3],
        "generated_tokens": gen, "prompt_tokens": prompt, "wall_s": wall, "steps": len(steps),
        "generated_tokens_per_s": gen / wall, "decode_only_tokens_per_s": sum(s.decode_rows for s in decode) /
        max(1e-9, sum(s.seconds for s in decode)), "prefill_tokens_per_s": prompt / max(1e-9, prefill_s),
        "max_batch": rep["max_batch"], "batch_plan": rep.get("batch_plan"),
        "planned_max_batch": (rep.get("batch_plan") or {}).get("planned_max_batch"),
        "mean_rows_per_step": sum(s.tokens for s in steps) / max(1, len(steps)),
        "bytes_read": nbytes, "bytes_read_per_generated_token": nbytes / max(1, gen),
        "expert_hit_rate": stats["expert_hit_rate"],
        "disk_bandwidth_bytes_per_s": bw, "disk_probes_bytes_per_s": probes,
        "matmul_flops_per_s": rate, "matmul_precision": args.compute_dtype, "matmul_bf16_flops_per_s": rate_bf16,
        **roof, "roofline_fraction": roof["roofline_s"] / wall,
        "ram_budget_bytes": budget, "peak_accounted_bytes": stats["peak_resident_bytes"], "peak_rss_bytes": peak,
        "rss_bound_bytes": bound, "rss_within_bound": peak <= bound, "interpreter_rss_bytes": base_rss,
        "compute_threads": torch.get_num_threads(), "kv_dtype": args.kv_dtype, "compute_dtype": args.compute_dtype,
        "batch_invariant": batch_invariant(args),
        "step_detail": [s.detail() for s in steps],
    }


def len_or(s: Step) -> int:
    """Segments in a step when all of them decode (a step with any prompt chunk counts as prefill)."""
    return s.logit_rows if s.tokens == s.logit_rows else -1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, nargs="?", default=Path("/work/synth/q3m_med"))
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=None, help="bytes (default: dense + scratch + experts / 4)")
    ap.add_argument("--max-batch", type=int, default=1024, help="sequences in flight at most (state bounds it too)")
    ap.add_argument("--prefill-chunk", type=int, default=BATCH_PREFILL_CHUNK,
                    help=f"prompt tokens per step, across prompts (default {BATCH_PREFILL_CHUNK}, `moestream batch`'s)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch compute threads (default 1: on a shared CPU, 2 threads made small ops 10-100x slower)")
    ap.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES, default="fp32",
                    help="KV cache storage: bf16 halves each sequence's state, so about twice as many run at once; "
                         "int8 and int4 quarter and eighth it (their group scales aside)")
    ap.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="many-row products' precision (EngineOptions.compute_dtype); the roofline's matmul rate is "
                         "measured in the same precision")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineOptions.batch_invariant (default: as `moestream batch`, on with fp32 compute)")
    ap.add_argument("--runner", choices=list(RUNNERS), default="job",
                    help="job: the requests as a `moestream batch` job (input file in, fsynced output file out); "
                         "scheduler: submitted straight to the server's Scheduler, results kept in memory")
    ap.add_argument("--keep", type=Path, default=None,
                    help="with --runner job: leave the job's in.jsonl and out.jsonl in this directory")
    ap.add_argument("--single-gen-len", type=int, default=16, help="one-stream decode tokens (0: skip it)")
    ap.add_argument("--no-probe", dest="probe", action="store_false",
                    help="skip the disk probe (no I/O floor in the roofline: for runs that must not load the disk)")
    ap.add_argument("--rss-trace", type=Path, default=None,
                    help="write a JSON line per engine step: RSS, VmHWM and what the books, the heap and the "
                         "mappings held at the step's RSS maximum (bench/rss_trace.py; a sampling thread: not for "
                         "timed runs)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    budget = args.budget or default_budget(args.model)
    single = single_stream(args.model, budget, args) if args.single_gen_len > 0 else None
    r = measure_batch(args, budget)
    if single:
        r["single_stream"] = single
        r["ratio_to_one_stream"] = r["generated_tokens_per_s"] / single["decode_tokens_per_s"]
    print(json.dumps(r) if args.json else _text(r))
    return 0


def _rate(r: dict) -> float:
    """The matmul rate the roofline used (the precision the run computed in)."""
    return r["matmul_bf16_flops_per_s"] if r["matmul_precision"] == "bf16" else r["matmul_flops_per_s"]


def _text(r: dict) -> str:
    lines = [f"{r['requests']} requests x ({r['prompt_len']} prompt + {r['gen_len']} new) on {r['model']}, "
             f"budget {format_bytes(r['ram_budget_bytes'])}, in flight <= {r['planned_max_batch'] or r['max_batch']}",
             f"generated {r['generated_tokens']} tokens in {r['wall_s']:.1f} s: {r['generated_tokens_per_s']:.1f} tok/s"
             f" (decode steps {r['decode_only_tokens_per_s']:.1f} tok/s, prefill {r['prefill_tokens_per_s']:.1f} tok/s)"]
    if "single_stream" in r:
        lines.append(f"one stream: {r['single_stream']['decode_tokens_per_s']:.2f} tok/s -> "
                     f"{r['ratio_to_one_stream']:.1f}x")
    lines += [f"roofline {r['roofline_s']:.1f} s (io {r['io_floor_s']:.1f} s at "
              f"{format_bytes(int(r['disk_bandwidth_bytes_per_s']))}/s, compute {r['compute_floor_s']:.1f} s at "
              f"{_rate(r) / 1e9:.0f} GFLOP/s {r['matmul_precision']}): fraction {r['roofline_fraction']:.2f}",
              f"bytes read per generated token {format_bytes(int(r['bytes_read_per_generated_token']))}, hit rate "
              f"{r['expert_hit_rate']:.2f}, peak RSS {format_bytes(r['peak_rss_bytes'])} (bound "
              f"{format_bytes(r['rss_bound_bytes'])}), failed {r['failed']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
