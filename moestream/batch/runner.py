"""Running batch requests through the server's continuous-batching Scheduler, from an asyncio loop.

Owns `run_batch(engine, tokenizer, requests, ...)`, the function `moestream batch`, the Ray workers and benchmarks
call: it keeps the running requests plus a short waiting line submitted (`window`: a quarter of those running, at
least 16, never more than twice --max-batch), so the scheduler admits a new one the moment another ends while
unadmitted requests hold little memory; prepares each line just before it is submitted, and hands every finished
output line to `emit`. Batch and
serve share one generation path (Scheduler.submit / Ticket.next), which is what makes their tokens identical.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from moestream.batch.inputs import BatchRequest
from moestream.batch.prepare import Job, RequestContext, prepare, response_line
from moestream.batch.report import BatchReport, Tally
from moestream.server.responses import collect
from moestream.server.protocol import Formatter
from moestream.server.scheduler import Scheduler, SchedulerConfig
from moestream.tokenizer import Tokenizer

Emit = Callable[[dict], None]
# requests waiting for admission at least, beyond those running: enough that a job's first steps prefill whole chunks
# (128 prompts of 32 tokens fill `moestream batch`'s default 4,096; with 16, the 1,024-request job of
# docs/performance.md spent its first eight steps on 1,000-1,700 prompt rows, each reading nearly every expert)
MIN_WAITING = 128
REFILL_S = 0.05  # how often the submitting loop looks for room when nothing finished


@dataclass
class BatchOptions:
    max_batch: int = 64  # sequences decoded together per engine step
    prefill_chunk: int = 256  # prompt tokens prefilled per step, across all prefilling sequences
    prefix_cache_bytes: int = 0  # saved-prefix reuse (0: off; a batch's memory goes to sequences in flight)
    max_tokens: int | None = None  # for bodies without max_tokens (None: the server's default, the context's rest)
    model_name: str | None = None  # the model id bodies must name (default: the checkpoint directory's name)

    def scheduler_config(self, max_queue: int | None = None) -> SchedulerConfig:
        return SchedulerConfig(self.max_batch, max_queue or self.in_flight, self.prefill_chunk,
                               self.prefix_cache_bytes)

    @property
    def in_flight(self) -> int:
        """Requests submitted at once: a second batch waits in the scheduler's queue to fill freed slots at once."""
        return 2 * self.max_batch


def request_context(engine, tokenizer: Tokenizer, options: BatchOptions) -> RequestContext:
    from moestream.config import read_model_config

    model_id = options.model_name or engine.path.resolve().name
    context = read_model_config(engine.path).get("max_position_embeddings")
    return RequestContext(tokenizer, model_id, engine.vocab_size, context, options.max_tokens)


def run_batch(engine, tokenizer: Tokenizer, requests: Iterable[BatchRequest], options: BatchOptions | None = None,
              emit: Emit | None = None, tally: Tally | None = None) -> BatchReport:
    """Run every request; each output line goes to `emit` as it finishes (or, without `emit`, into
    report.results). Returns the run's report (tokens, wall time, I/O, memory)."""
    options = options or BatchOptions()
    tally = tally or Tally(engine)
    results: list[dict] = []
    sink = emit or results.append
    sched = Scheduler(engine, tokenizer, options.scheduler_config()).start()
    first: list[Job] = []
    try:
        asyncio.run(execute(sched, request_context(engine, tokenizer, options), requests, counted(sink, tally),
                            options.in_flight, tally.retried, first.append))
    finally:
        sched.stop()
    report = tally.report()
    report.results = results if emit is None else None
    report.steps, report.widest_step = sched.counters["steps"], sched.counters["widest_step"]
    if first:
        req = first[0].request
        report.batch_plan = sched.plan_batch(len(req.prompt_ids), req.max_tokens)
    return report


def counted(sink: Emit, tally: Tally) -> Emit:
    def emit(line: dict) -> None:
        sink(line)
        tally.add(line)

    return emit


async def execute(sched: Scheduler, ctx: RequestContext, requests: Iterable[BatchRequest], emit: Emit,
                  in_flight: int, on_retry: Callable[[], None] | None = None,
                  on_first: Callable[[Job], None] | None = None) -> None:
    """Submit requests as slots free up, emit each output line as its request ends. Must run in one event loop.

    A request refused for lack of room for its sequence state (507) while others ran is not a result: it runs
    again later, and from then on fewer requests are in flight, so a batch too large for the budget shrinks
    instead of failing requests. Only a request that does not fit on its own gets the 507 in the output."""
    todo = iter(requests)
    retry: deque[Job] = deque()
    pending: set[asyncio.Task] = set()
    try:
        while True:
            while len(pending) < window(sched, in_flight):
                item = retry.popleft() if retry else _next_job(todo, ctx, emit)
                if item is None:
                    break
                if on_first is not None:
                    on_first(item)
                    on_first = None
                pending.add(asyncio.ensure_future(_run_one(sched, item)))
            if not pending:
                return
            done, pending = await asyncio.wait(pending, timeout=REFILL_S, return_when=asyncio.FIRST_COMPLETED)
            crowded = len(pending) + len(done) > 1
            for task in done:
                job, line = task.result()
                if crowded and _no_room(line):
                    retry.append(job)
                    in_flight = max(1, len(pending))
                    if on_retry is not None:
                        on_retry()
                else:
                    emit(line)
    finally:
        for task in pending:
            task.cancel()


def window(sched: Scheduler, in_flight: int) -> int:
    """Requests to keep submitted: those running plus a waiting line of a quarter of them (at least
    MIN_WAITING), at most `in_flight`. Each waiting request holds its parsed body and ticket outside the budget,
    and the scheduler admits a wave over several steps anyway (a prefill chunk at a time), so a longer line would
    only hold memory."""
    running = len(sched.active)
    return min(in_flight, running + max(MIN_WAITING, running // 4))


def _next_job(todo: Iterator[BatchRequest], ctx: RequestContext, emit: Emit) -> Job | None:
    """The next runnable job; lines that cannot run are emitted on the way."""
    for req in todo:
        item = prepare(req, ctx)
        if isinstance(item, Job):
            return item
        emit(item)
    return None


def _no_room(line: dict) -> bool:
    return line["response"] is not None and line["response"]["status_code"] == 507


async def _run_one(sched: Scheduler, job: Job) -> tuple[Job, dict]:
    ticket = sched.submit(job.request)
    try:
        status, body = await collect(ticket, Formatter(job.parsed))
    finally:
        sched.cancel(ticket)  # a no-op when it finished; frees its state at once when the job is interrupted
    return job, response_line(job.id, job.custom_id, status, body)
