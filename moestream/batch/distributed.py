"""`moestream batch --ray`: one engine per Ray worker, the driver keeping the one output file and exactly-once.

Owns the worker actor (it opens MODEL from its own node's path and runs chunks of requests through its own
Scheduler with runner.execute, two chunks at a time so its batch never drains between them) and the driver loop:
chunks out, result lines back, each id written once. A worker that dies takes only unreported work with it:
its chunks go back to the queue for the others. Ray is the optional `ray` extra, imported only here.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Iterator

from moestream.batch.inputs import BatchRequest
from moestream.batch.report import BatchReport, Tally
from moestream.batch.runner import BatchOptions, Emit, counted, execute, request_context
from moestream.errors import MoestreamError

CHUNKS_PER_WORKER = 2  # in flight per worker: the next chunk is already queued when one ends
RAY_CHUNK_MAX = 512  # requests a chunk by default at most (4 x --max-batch else), so a job spreads over the workers
WORKER_PREFIX = "moestream-batch-worker"


class RayError(MoestreamError):
    """Ray is missing, cannot start or reach its cluster, or every worker died."""


class BatchWorker:
    """A Ray actor (async: its chunks share one event loop and one Scheduler, hence one engine batch)."""

    def __init__(self, model: str, ram_budget: int | None, state_room: str | None, threads: int | None,
                 options: BatchOptions, kv_dtype: str = "fp32", compute_dtype: str = "fp32",
                 batch_invariant: bool = False):
        from moestream.engine.engine import Engine
        from moestream.server.scheduler import Scheduler
        from moestream.tokenizer import Tokenizer

        self.engine = Engine.open(model, ram_budget=ram_budget, state_room=state_room, kv_dtype=kv_dtype,
                                  compute_dtype=compute_dtype, batch_invariant=batch_invariant,
                                  head_rows=state_room is not None)  # as batch/job.py
        if threads:
            import torch

            torch.set_num_threads(threads)
        tokenizer = Tokenizer.load(model)
        self.ctx = request_context(self.engine, tokenizer, options)
        self.in_flight = options.in_flight
        queue = CHUNKS_PER_WORKER * self.in_flight  # every chunk's requests may wait at once
        self.sched = Scheduler(self.engine, tokenizer, options.scheduler_config(queue)).start()

    async def run(self, chunk: list[BatchRequest]) -> tuple[list[dict], dict]:
        lines: list[dict] = []
        retries: list[int] = []
        await execute(self.sched, self.ctx, chunk, lines.append, self.in_flight, lambda: retries.append(1))
        s = self.engine.stats
        return lines, {"io": (s["bytes_read"], s["expert_hits"], s["expert_misses"]),
                       "peak": s["peak_resident_bytes"], "budget": s["ram_budget_bytes"], "retried": len(retries)}


def _ray():
    try:
        import ray
    except ImportError:
        raise RayError("--ray needs Ray: pip install 'moestream[ray]'") from None
    return ray


def _connect(ray, address: str) -> None:
    if ray.is_initialized():
        return  # a caller (a test, a notebook) already joined a cluster: use it
    try:
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayError(f"cannot start or reach the Ray cluster{' at ' + address if address else ''}: {e}") from None


def default_chunk(in_flight: int, workers: int, remaining: int | None) -> int:
    """Requests a chunk when --ray-chunk is not given: twice a worker's in-flight requests, at most RAY_CHUNK_MAX,
    and no more than gives every worker its CHUNKS_PER_WORKER chunks of a job of `remaining` requests."""
    chunk = min(2 * in_flight, RAY_CHUNK_MAX)
    if remaining:
        chunk = min(chunk, -(-remaining // (workers * CHUNKS_PER_WORKER)))
    return max(1, chunk)


def _chunks(todo: Iterator[BatchRequest], size: int) -> Iterator[list[BatchRequest]]:
    while chunk := list(itertools.islice(todo, size)):
        yield chunk


def _first_line(e: Exception | None) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def run_on_ray(cfg, todo: Iterator[BatchRequest], emit: Emit, tally: Tally, remaining: int | None = None) -> BatchReport:
    """Run the requests of `todo` (`remaining` of them, when known) on Ray workers; every result line goes to
    `emit` exactly once."""
    ray = _ray()
    _connect(ray, cfg.ray)
    alive = [n for n in ray.nodes() if n.get("Alive")]
    n_workers = cfg.ray_workers or max(1, len(alive))
    chunk = cfg.ray_chunk or default_chunk(cfg.options.in_flight, n_workers, remaining)
    actor = ray.remote(num_cpus=1, max_restarts=0, max_concurrency=CHUNKS_PER_WORKER + 1)(BatchWorker)
    workers = {i: actor.options(name=f"{WORKER_PREFIX}-{i}", scheduling_strategy="SPREAD").remote(
        cfg.model, cfg.ram_budget, cfg.state_room, cfg.threads, cfg.options, cfg.kv_dtype, cfg.compute_dtype,
        cfg.invariant())
        for i in range(n_workers)}
    driver = _Driver(ray, workers, _chunks(todo, chunk), counted(emit, tally), tally)
    try:
        driver.run()
    finally:
        for w in driver.workers.values():
            ray.kill(w)
    tally.engine_delta = driver.io_total()
    report = tally.report(workers=n_workers)
    report.reassigned = driver.reassigned
    return report


class _Driver:
    """Hands chunks to live workers, writes what comes back once, and requeues what a dead worker held."""

    def __init__(self, ray, workers: dict[int, Any], chunks: Iterator[list[BatchRequest]], emit: Emit, tally: Tally):
        self.ray, self.workers, self.chunks, self.emit, self.tally = ray, workers, chunks, emit, tally
        self.requeued: deque[list[BatchRequest]] = deque()
        self.running: dict[Any, tuple[int, list[BatchRequest]]] = {}  # object ref -> (worker, chunk)
        self.written: set[str] = set()
        self.io: dict[int, tuple[int, int, int]] = {}
        self.reassigned = 0
        self.last_error: Exception | None = None

    def run(self) -> None:
        self._fill()
        while self.running:
            [ref], _ = self.ray.wait(list(self.running), num_returns=1)
            wid, chunk = self.running.pop(ref)
            try:
                lines, stats = self.ray.get(ref)
            except self.ray.exceptions.RayError as e:  # the worker died (or its engine could not open)
                self._lost(wid, chunk, e)
            else:
                self._done(wid, lines, stats)
            self._fill()
        if self.requeued:
            raise RayError(f"every Ray worker died (the last said: {_first_line(self.last_error)}); what finished "
                           "is written: run the same command again to continue")

    def _next(self) -> list[BatchRequest] | None:
        return self.requeued.popleft() if self.requeued else next(self.chunks, None)

    def _fill(self) -> None:
        for wid, w in self.workers.items():
            while sum(1 for i, _ in self.running.values() if i == wid) < CHUNKS_PER_WORKER:
                chunk = self._next()
                if chunk is None:
                    return
                self.running[w.run.remote(chunk)] = (wid, chunk)

    def _done(self, wid: int, lines: list[dict], stats: dict) -> None:
        for line in lines:
            if line["id"] not in self.written:
                self.written.add(line["id"])
                self.emit(line)
        self.io[wid] = stats["io"]
        self.tally.peak = max(self.tally.peak, stats["peak"])
        self.tally.budget = stats["budget"]
        self.tally.retries += stats["retried"]

    def _lost(self, wid: int, chunk: list[BatchRequest], error: Exception) -> None:
        """The worker died: none of this chunk was written; it goes to the others."""
        if wid in self.workers:
            self.ray.kill(self.workers.pop(wid))  # a worker whose task failed is not trusted with more
        self.last_error = error
        self.requeued.append([r for r in chunk if r.id not in self.written])
        self.reassigned += 1

    def io_total(self) -> tuple[int, int, int]:
        return tuple(sum(v[k] for v in self.io.values()) for k in range(3))  # type: ignore[return-value]
