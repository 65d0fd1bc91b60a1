"""Where a warm decode step's time goes, for the GQA families (qwen3_moe, mixtral): wall-clock splits.

    python bench/decode_split.py MODEL [--threads 2] [--tokens 24] [--prompt-len 16] [--native|--no-native]
                                 [--warm-long 512] [--prefill 5] [--compute-dtype fp32|bf16]

Opens MODEL with a budget that holds every expert, decodes `--tokens` greedy tokens once to warm the cache (and
the page cache), then decodes the same tokens again from a fresh sequence with timers wrapped around the pieces
of a step: norms, the attention projections (q/k/v/o), the rest of attention (q/k norms, rope, KV append, scores),
the router (linear + top-k), the routed experts (the runner; its native kernel call and the lookahead separately),
the lm_head, the native runs of every layer of a warm token (DecoderModel.decode_layers) and their Python (KV
rows, checks; the runner's bookkeeping apart), and
"other" (the step minus all of those: embedding, residual adds, sampling, the engine's bookkeeping). Prints a
table (ms per token and share), the native decode layer's own phases (cpu.layer_times: prep, q/k/v, attention,
o_proj, router, experts), the timed decode's MoE layer steps (how many ran their experts inside the native
decode layer, took the runner's warm path or its general one; experts read ahead) and one JSON line. The timers
cost about a microsecond per call.

`--prefill N` splits a warm prefill of the `--prompt-len` prompt instead (what vs_llamacpp.py --warm times as
its 16-token prefill): after the warm decode, the prompt is prefilled N times in fresh sequences under the same
timers, and the table is per prefill (ms per prefill, shares of it).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import contextmanager

import moestream  # noqa: F401  # before torch: its OpenMP runtime's wait policy (moestream/omp.py)
import torch

from moestream import Engine
from moestream.experts import dispatch, prefetch
from moestream.kernels import cpu
from moestream.models import attention, base, blocks

try:
    from moestream.kernels import fused
except ImportError:  # an older tree (PYTHONPATH=<tree>) has no fused kernels
    fused = None

SPENT: dict[str, float] = defaultdict(float)
STACK: list[list] = []  # [name, start, time in timed children, folds its children in]
CLOCK = [time.perf_counter]


def timed(name: str, fn, fold: bool = False):
    """Exclusive time: a timed call inside another is subtracted from its parent, except inside a folding parent
    (lm_head, lookahead), which keeps its children's time."""
    def wrapper(*args, **kwargs):
        if STACK and STACK[-1][3]:
            return fn(*args, **kwargs)
        STACK.append([name, CLOCK[0](), 0.0, fold])
        try:
            return fn(*args, **kwargs)
        finally:
            _, start, children, _ = STACK.pop()
            spent = CLOCK[0]() - start
            SPENT[name] += spent - children
            if STACK:
                STACK[-1][2] += spent
    return wrapper


@contextmanager
def instrumented():
    """Timers around the step's pieces (module attributes patched, restored on exit)."""
    wanted = [
        (attention, "linear", "attention projections q/k/v/o", False),
        (attention, "linear_many", "attention projections q/k/v/o", False),
        (attention.GQAMixer, "__call__", "attention: qk-norm, rope, KV, scores", False),
        (base, "rms_norm", "norms (layer + final)", False),
        # every family's router (linear + top-k); an older tree's softmax router lived in base
        *[(getattr(blocks, cls, None), "__call__", "router (linear + top-k)", False)
          for cls in ("SoftmaxRouter", "SigmoidRouter", "BiasedRouter")],
        (base, "softmax_topk", "router (linear + top-k)", False),
        (base.DecoderModel, "head", "lm_head (+ final norm)", True),
        (dispatch.ExpertRunner, "run", "routed experts: runner and Python", False),
        (dispatch.ExpertRunner, "resident_done", "routed experts: runner and Python", False),
        (dispatch.ExpertRunner, "resident_run", "routed experts: runner and Python", False),
        (prefetch.Lookahead, "predict", "lookahead (next layer's router)", True),
        (fused, "moe_glu_bf16", "routed experts: native kernel", False),
        # the one-call decode layer (GQAMixer.decode_block): its native call, and its Python (KV row, checks)
        (getattr(fused, "DecodeBlock", None), "__call__", "decode block: native (attention, router, experts)", False),
        (attention.GQAMixer, "decode_block", "decode block: Python (KV row, checks)", False),
        # every layer of a warm token in native runs (DecoderModel.decode_layers): the runs, and the Python around
        (getattr(fused, "DecodeLayers", None), "__call__", "decode layers: native (attention, router, experts)", False),
        (base.DecoderModel, "decode_layers", "decode layers: Python (KV rows, runs)", False),
    ]
    # what an older tree lacks (run with PYTHONPATH=<tree>) is simply not timed
    patches = [(obj, attr, timed(name, getattr(obj, attr), fold)) for obj, attr, name, fold in wanted
               if obj is not None and hasattr(obj, attr)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def decode(eng: Engine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    st = eng.new_sequence()
    logits = eng.prefill(st, prompt)
    SPENT.clear()  # the split is of decode steps only
    out, t0 = [], CLOCK[0]()
    for _ in range(tokens):
        tok = int(torch.argmax(logits))
        out.append(tok)
        (logits,) = eng.step([(st, [tok])])
    dt = CLOCK[0]() - t0
    eng.free(st)
    return out, dt


def prefills(eng: Engine, prompt: list[int], times: int) -> float:
    """Seconds of `times` warm prefills of `prompt`, each in a fresh sequence (the split counts only them)."""
    SPENT.clear()
    total = 0.0
    for _ in range(times):
        st = eng.new_sequence()
        t0 = CLOCK[0]()
        eng.prefill(st, prompt)
        total += CLOCK[0]() - t0
        eng.free(st)
    return total


def _pool_stats() -> dict[str, int]:
    """The native pool's counters (an older tree has none: {})."""
    return cpu.pool_stats() if hasattr(cpu, "pool_stats") else {}


def _layer_steps(eng: Engine) -> dict[str, int]:
    """The runner's counters so far: MoE layer steps, those of the warm one-token path, those whose experts ran
    inside the native decode layer, experts read ahead."""
    t = eng.runner.times
    tables = getattr(eng.runner, "tables", {})
    return {"steps": t.steps, "resident": t.resident_steps, "ahead": t.prefetch_reads,
            "native": sum(tb.used for tb in tables.values() if tb is not None)}


def split(total: float, tokens: int) -> dict[str, float]:
    rows = dict(sorted(SPENT.items(), key=lambda kv: -kv[1]))
    rows["other (embed, residuals, engine)"] = total - sum(rows.values())
    return {k: v / tokens for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--budget", default="20GB")
    ap.add_argument("--cpu-time", action="store_true",
                    help="the calling thread's CPU time instead of wall time (with --threads 1: all the compute)")
    ap.add_argument("--no-native", action="store_true", help="torch paths only (cpu.disabled())")
    ap.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the engine's precision of many-row products (EngineOptions.compute_dtype)")
    ap.add_argument("--warm-long", type=int, default=0,
                    help="first prefill this many random tokens in a throwaway sequence, as vs_llamacpp.py --warm's "
                         "warm pass does (on the peer checkpoint 512 leave 1,672 of its 2,048 experts cached: its "
                         "deep layers route them to 29-42 of their 64)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="split this many warm prefills of the prompt instead of the decode (per prefill)")
    args = ap.parse_args()
    if args.cpu_time:
        CLOCK[0] = time.thread_time
    eng = Engine.open(args.model, ram_budget=args.budget, threads=args.threads, compute_dtype=args.compute_dtype)
    cpu.set_threads(args.threads)
    prompt = [(i * 7919) % eng.vocab_size for i in range(3, 3 + args.prompt_len)]
    ctx = cpu.disabled() if args.no_native else contextmanager(lambda: (yield))()
    with ctx:
        if args.warm_long:
            import random
            rng = random.Random(1)
            st = eng.new_sequence()
            eng.prefill(st, [rng.randrange(3, eng.vocab_size) for _ in range(args.warm_long)])
            eng.free(st)
        first, _ = decode(eng, prompt, args.tokens)  # warm: every expert these tokens route to is cached
        pool0, steps0 = _pool_stats(), _layer_steps(eng)
        phases = hasattr(cpu, "layer_times") and cpu.available() and not args.no_native
        if phases:
            cpu.layer_times(True)  # the native decode layer's phase clocks, from zero
        with instrumented():
            if args.prefill:
                again, total = first, prefills(eng, prompt, args.prefill)
            else:
                again, total = decode(eng, prompt, args.tokens)
        inner = cpu.layer_times(False) if phases else {}
        pool = {k: v - pool0.get(k, 0) for k, v in _pool_stats().items()}
        steps = {k: v - steps0[k] for k, v in _layer_steps(eng).items()}
    tables = getattr(eng.runner, "tables", {})  # an older tree has none
    fused_share = sum(t.used for t in tables.values() if t is not None) / max(1, eng.runner.times.resident_steps)
    assert again == first, "the warm run decoded other tokens"
    units = args.prefill or args.tokens  # the table's unit: one prefill, or one decoded token
    rows = split(total, units)
    ms = total / units * 1e3
    clock = "thread CPU time" if args.cpu_time else "wall"
    what = f"prefill of {args.prompt_len} tokens" if args.prefill else "token"
    rate = args.prompt_len * units / total if args.prefill else units / total
    print(f"warm {'prefill' if args.prefill else 'decode'} ({clock}): {rate:.2f} tok/s, {ms:.2f} ms/{what}, "
          f"threads {args.threads}, "
          f"native {cpu.available() and not args.no_native} ({cpu.simd() or 'scalar'})")
    # (an older tree's simd() said only whether AVX-512 was in: True/False)
    print(f"  layer steps with the experts inside the native decode layer: {fused_share:.0%} of resident steps "
          f"since the engine opened (the warm decode's included)")
    print(f"  timed run's MoE layer steps (its prompt's prefill included, one a layer): {steps['steps']}; native "
          f"decode layer {steps['native']}, warm path {steps['resident']}, general path "
          f"{steps['steps'] - steps['resident']}; experts read ahead {steps['ahead']}; cached experts "
          f"{len(eng.runner.cache)}")
    for name, sec in rows.items():
        print(f"  {name:<40}{sec * 1e3:>8.2f} ms {sec * 1e3 / ms:>7.1%}")
    if pool:
        print(f"  native pool per {what}: {pool['runs'] / units:.1f} threaded calls, the caller slept in "
              f"{pool['caller_sleeps'] / units:.1f}, a worker slept between calls "
              f"{pool['worker_sleeps'] / units:.1f} times; the caller polled > 2000 pauses in "
              f"{pool.get('long_waits', 0) / units:.1f}")
        if "wait_ns" in pool:  # an older tree's pool has no such clock
            print(f"  the caller waited for a worker's started part (the threaded calls' tails) "
                  f"{pool['wait_ns'] / 1e6 / units:.2f} ms per {what}")
        if pool.get("prefetches"):
            print(f"  background prefetch per {what}: {pool['prefetches'] / units:.1f} posted, "
                  f"{pool['prefetches_cut'] / units:.1f} cut short, "
                  f"{pool['prefetch_bytes'] / units / 1e6:.1f} MB read ahead")
    inner_ms = {k: v / 1e6 / units for k, v in inner.items() if k != "calls"}
    if inner.get("calls"):
        print(f"  inside the native decode layer ({inner['calls'] / units:.0f} calls a token, wall):")
        for name, v in inner_ms.items():
            print(f"    {name:<38}{v:>8.2f} ms {v / ms:>7.1%}")
    print(json.dumps({"tokens_per_s": rate, "ms_per_token": ms, "unit": what, "threads": args.threads,
                      "clock": clock, "split_ms": {k: v * 1e3 for k, v in rows.items()}, "tokens": first[:8],
                      "pool": pool, "layer_steps": steps, "native_layer_ms": inner_ms}))


if __name__ == "__main__":
    main()
