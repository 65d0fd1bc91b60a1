"""Where a cold decode step leaves the disk idle: every expert read and every MoE layer step, timestamped.

    python bench/io_timeline.py MODEL --ram-budget 931MB [--gen-len 24] [--skip 4] [--show-step 10] [--json OUT]

Runs one cold decode like `moestream bench` (random prompt, temperature 1, fixed seed) with the reader's
`_read_run` and the runner's `run` wrapped to record (start, end) wall times; nothing else changes. Prints, over
the decode steps after the first `--skip`: the share of wall time with at least one read in flight, the idle
gaps' distribution, how long a read waited between being queued with a thread free and starting (GIL and
wake-up latency), the reading thread's page faults and system CPU per read (a read into a buffer never touched
before faults in every page of it inside the read: on this VM, at ~12 us a page once the host has taken the page
back, docs/performance.md "Fresh pages"), and optionally one step's timeline (MoE steps and reads, in ms from the
step's start).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from moestream import Engine
from moestream.bench import _pick, drop_page_cache, model_files
from moestream.config import parse_bytes
from moestream.experts import dispatch, reader


RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # Linux: the calling thread alone


class Recorder:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.reads: list[tuple[float, float, int]] = []  # (start, end, bytes)
        self.costs: list[tuple[int, float]] = []  # per read, as `reads`: (minor faults, system CPU s) of its thread
        self.moe: list[tuple[float, float, int]] = []  # (start, end, layer)
        self.lags: list[float] = []  # queued with a thread free -> started
        self._queued: dict[int, float] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def install(self) -> None:
        rec, read_run, submit, run = self, reader.Reader._read_run, reader.Reader.submit, dispatch.ExpertRunner.run

        def timed_read(self, r, view):
            queued = rec._queued.pop(id(r), None)
            t = rec.now()
            if queued is not None:
                rec.lags.append(t - queued)
            ru = resource.getrusage(RUSAGE_THREAD)
            calls = read_run(self, r, view)
            ru1 = resource.getrusage(RUSAGE_THREAD)
            rec.reads.append((t, rec.now(), r.length))
            rec.costs.append((ru1.ru_minflt - ru.ru_minflt, ru1.ru_stime - ru.ru_stime))
            return calls

        def timed_submit(self, plan, priority=reader.DEMAND, then=None):
            idle = self._inflight < self.threads and not any(q[2].next < len(q[2].plan.runs) for q in self._queue)
            for r in plan.runs:
                rec._queued.pop(id(r), None)
                if idle:
                    rec._queued[id(r)] = rec.now()
            return submit(self, plan, priority, then)

        def timed_run(self, layer, *a, **kw):
            t = rec.now()
            out = run(self, layer, *a, **kw)
            rec.moe.append((t, rec.now(), layer))
            return out

        reader.Reader._read_run, reader.Reader.submit, dispatch.ExpertRunner.run = timed_read, timed_submit, timed_run


def busy_time(reads: list[tuple[float, float, int]], a: float, b: float) -> tuple[float, list[float]]:
    """Seconds in [a, b) with at least one read in flight, and the idle gaps between reads."""
    spans = sorted((max(s, a), min(e, b)) for s, e, _ in reads if e > a and s < b)
    busy, gaps, cur = 0.0, [], None
    for s, e in spans:
        if cur is None or s > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
                gaps.append(s - cur[1])
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur is not None:
        busy += cur[1] - cur[0]
    return busy, gaps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--ram-budget", required=True)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=24)
    ap.add_argument("--skip", type=int, default=4, help="decode steps left out of the figures (gate warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show-step", type=int, default=None, help="print this decode step's timeline")
    ap.add_argument("--json", type=Path, default=None, help="write the raw events here")
    args = ap.parse_args()

    rec = Recorder()
    rec.install()
    drop_page_cache(model_files(args.model))
    eng = Engine.open(args.model, ram_budget=parse_bytes(args.ram_budget))
    gen = torch.Generator().manual_seed(args.seed)
    state = eng.new_sequence()
    logits = eng.prefill(state, torch.randint(0, eng.vocab_size, (args.prompt_len,), generator=gen).tolist())
    tok = _pick(logits, 1.0, gen)
    rec.lags.clear()
    steps = []
    for _ in range(args.gen_len):
        t = rec.now()
        (logits,) = eng.step([(state, [tok])])
        tok = _pick(logits, 1.0, gen)
        steps.append((t, rec.now()))
    times = eng.runner.times
    eng.close()

    a, b = steps[min(args.skip, len(steps) - 1)][0], steps[-1][1]
    n = len(steps) - min(args.skip, len(steps) - 1)
    busy, gaps = busy_time(rec.reads, a, b)
    nbytes = sum(nb for s, e, nb in rec.reads if a <= s < b)
    print(f"steps {n}: {n / (b - a):.2f} tok/s, disk busy {busy / (b - a):.1%} of the time, "
          f"{nbytes / n / 1e6:.1f} MB read per token, {nbytes / max(busy, 1e-9) / 1e9:.2f} GB/s while busy")
    if gaps:
        q = statistics.quantiles(gaps, n=10) if len(gaps) > 1 else gaps
        print(f"idle gaps: {len(gaps)}, {sum(gaps) * 1e3 / n:.1f} ms per token; deciles (ms) "
              + " ".join(f"{1e3 * x:.2f}" for x in q))
    picked = [c for (s, _, _), c in zip(rec.reads, rec.costs) if a <= s < b]
    if picked:
        print(f"per read: {statistics.mean(f for f, _ in picked):.0f} page faults, "
              f"{1e3 * statistics.mean(st for _, st in picked):.1f} ms system CPU of its thread (mean of {len(picked)})")
    if rec.lags:
        print(f"queued with a thread free -> started: median {1e3 * statistics.median(rec.lags):.3f} ms, "
              f"max {1e3 * max(rec.lags):.3f} ms ({len(rec.lags)} reads)")
    print(f"read-ahead: {times.prefetch_reads} queued, {times.prefetch_used} "
          f"used, {times.prefetch_withdrawn} withdrawn, {times.prefetch_joined} joined by a step")
    if args.show_step is not None:
        s0, s1 = steps[args.show_step]
        events = [("moe", s, e, f"layer {lay}") for s, e, lay in rec.moe if s0 <= s < s1]
        events += [("read", s, e, f"{nb >> 10} KiB") for s, e, nb in rec.reads if s0 <= s < s1]
        print(f"step {args.show_step}: {1e3 * (s1 - s0):.1f} ms")
        for kind, s, e, what in sorted(events, key=lambda x: x[1]):
            print(f"  {kind:4s} {1e3 * (s - s0):8.2f} {1e3 * (e - s0):8.2f}  {what}")
    if args.json is not None:
        args.json.write_text(json.dumps({"reads": rec.reads, "moe": rec.moe, "steps": steps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
