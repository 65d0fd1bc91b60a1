"""One `moestream batch` job: an input file in, an output file out, resumable after any kill.

Owns the order that keeps a job safe: index and fingerprint the input, check the output belongs to it, cut a torn
tail and skip what is done, and only then open the model (locally, or Ray workers) and run what is left, every
result going through the output writer. Ctrl-C keeps every finished result.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moestream.batch.inputs import index_input
from moestream.batch.output import OutputWriter, check_owner, lock_output, scan
from moestream.batch.report import BatchReport, Tally
from moestream.batch.runner import BatchOptions, run_batch


@dataclass
class JobConfig:
    model: str
    input: str
    output: str
    ram_budget: int | None = None
    state_room: str | None = None
    threads: int | None = None  # torch CPU threads for the forward pass (default: the engine's choice)
    options: BatchOptions = field(default_factory=BatchOptions)
    progress: bool | None = None  # None: a bar only on a terminal
    price_per_hour: float | None = None
    group_lines: int = 64  # results per fsynced group: a kill loses at most this many finished results
    group_s: float = 2.0  # ...or this many seconds of them
    ray: str | None = None  # a Ray address ("" starts or joins a local cluster); None runs in this process
    ray_workers: int | None = None
    ray_chunk: int | None = None
    kv_dtype: str = "fp32"  # KV cache storage (EngineOptions.kv_dtype)
    compute_dtype: str = "fp32"  # many-row products' precision (EngineOptions.compute_dtype)
    # a request's results independent of its step companions (EngineOptions.batch_invariant), so a local run and
    # Ray workers (which batch requests differently) give the same outputs; None: on when computing in fp32
    batch_invariant: bool | None = None

    def invariant(self) -> bool:
        if self.batch_invariant is None:
            return self.compute_dtype == "fp32"
        return self.batch_invariant


def run_job(cfg: JobConfig, engine=None) -> BatchReport:
    """Run (or resume) the job. `engine`: an Engine already open on cfg.model (a benchmark that meters its steps);
    it stays open. Without it the job opens its own (or runs on Ray when cfg.ray is set)."""
    if engine is not None and cfg.ray is not None:
        raise ValueError("run_job: an open engine runs the job in this process; it cannot go with --ray")
    index = index_input(cfg.input)
    output = Path(cfg.output)
    held = lock_output(output)  # before anything reads or cuts the output: one job at a time writes it
    try:
        return _run_locked(cfg, index, output, engine)
    finally:
        os.close(held)


def _run_locked(cfg: JobConfig, index, output: Path, engine) -> BatchReport:
    check_owner(output, index)
    resume = scan(output)
    if resume.cut_bytes:
        print(f"note: cut a torn last line ({resume.cut_bytes} bytes) from {output}; that request runs again",
              file=sys.stderr)
    ids = index.ids()
    done = resume.done.intersection(ids)
    writer = OutputWriter(output, cfg.group_lines, cfg.group_s)
    try:
        if len(done) == len(ids):
            return Tally(None, len(ids), len(done)).report()
        todo = index.requests(skip=done)
        if cfg.ray is not None:
            from moestream.batch.distributed import run_on_ray

            tally = Tally(None, len(ids), len(done), cfg.progress, cfg.price_per_hour)
            return run_on_ray(cfg, todo, writer.add, tally, len(ids) - len(done))
        return _run_local(cfg, todo, writer, len(ids), len(done), engine)
    finally:
        writer.close()


def _run_local(cfg: JobConfig, todo, writer: OutputWriter, total: int, skipped: int, engine=None) -> BatchReport:
    from moestream.engine.engine import Engine
    from moestream.tokenizer import Tokenizer

    owned = engine is None
    if owned:
        # many sequences: their state grows into the cache's room, which the head's resident rows would take
        engine = Engine.open(cfg.model, ram_budget=cfg.ram_budget, state_room=cfg.state_room, kv_dtype=cfg.kv_dtype,
                             compute_dtype=cfg.compute_dtype, batch_invariant=cfg.invariant(),
                             head_rows=cfg.state_room is not None)
    try:
        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)  # after open(), which picks its own default
        tally = Tally(engine, total, skipped, cfg.progress, cfg.price_per_hour)
        return run_batch(engine, Tokenizer.load(cfg.model), todo, cfg.options, emit=writer.add, tally=tally)
    finally:
        if owned:
            engine.close()
