"""What a batch run did: the live progress bar, the running tally, and the final report (text or one JSON object).

Owns the figures the issue asks a batch to report: requests, failures, prompt and generated tokens, wall time,
aggregate tokens/s, expert bytes read per generated token, expert hit rate, peak resident bytes against the
budget, and the cost per million tokens at a given price per hour. It reads Engine.stats and nothing else.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from tqdm import tqdm

from moestream.config import format_bytes


@dataclass
class BatchReport:
    total: int  # requests in the input (duplicates of one custom_id count once)
    skipped: int  # already in the output when this run started (a resumed job)
    requests: int  # finished in this run (successes and failures)
    failed: int  # of those, the ones whose line is an error or a non-200 response
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float  # generated tokens per second of wall time, all sequences together
    bytes_read: int  # expert bytes read from the checkpoint during the run
    bytes_per_generated_token: float | None
    expert_hit_rate: float | None
    peak_resident_bytes: int
    ram_budget_bytes: int | None
    price_per_hour: float | None = None
    cost_per_million_generated: float | None = None  # wall time priced, over generated tokens
    cost_per_million_tokens: float | None = None  # over prompt + generated tokens
    workers: int = 1
    reassigned: int = 0  # Ray: chunks that went to another worker after theirs died
    retried: int = 0  # requests run again because the budget had no room for their state beside the others
    steps: int = 0  # engine steps (one forward pass over every sequence in flight)
    widest_step: int = 0  # the most sequences one step advanced
    batch_plan: dict | None = None  # Scheduler.plan_batch for the first request's shape: state per sequence, room
    results: list[dict] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("results")
        return d


def _engine_counts(stats: dict) -> tuple[int, int, int]:
    return stats["bytes_read"], stats["expert_hits"], stats["expert_misses"]


def failed(line: dict) -> bool:
    """Whether an output line is a failure: an error line, or a response other than 200."""
    response = line.get("response")
    return line.get("error") is not None or response is None or response.get("status_code") != 200


class Tally:
    """Counts output lines as they are emitted, drives the progress bar, and builds the report at the end."""

    def __init__(self, engine=None, total: int | None = None, skipped: int = 0, progress: bool | None = False,
                 price_per_hour: float | None = None):
        self.engine, self.total, self.skipped, self.price = engine, total, skipped, price_per_hour
        self.requests = self.failed = self.prompt_tokens = self.generated = self.retries = 0
        self.start = time.perf_counter()
        self.base = _engine_counts(engine.stats) if engine is not None else (0, 0, 0)
        self.engine_delta: tuple[int, int, int] | None = None  # set directly when engines are elsewhere (Ray)
        self.peak, self.budget = 0, None
        self.bar = None
        if progress is not False and total is not None:
            # progress None: only on a terminal (tqdm's own check)
            self.bar = tqdm(total=total, initial=skipped, unit="req", desc="batch", file=sys.stderr,
                            disable=None if progress is None else False, dynamic_ncols=True, smoothing=0.1)

    def add(self, line: dict) -> None:
        self.requests += 1
        if failed(line):
            self.failed += 1
        else:
            usage = line["response"]["body"].get("usage") or {}
            self.prompt_tokens += usage.get("prompt_tokens", 0)
            self.generated += usage.get("completion_tokens", 0)
        if self.bar is not None:
            self.bar.update(1)
            elapsed = max(1e-9, time.perf_counter() - self.start)
            self.bar.set_postfix_str(f"{self.generated / elapsed:.1f} tok/s, {self.failed} failed", refresh=False)

    def retried(self) -> None:
        self.retries += 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def report(self, workers: int = 1) -> BatchReport:
        self.close()
        wall = time.perf_counter() - self.start
        bytes_read, hits, misses = self._io()
        if self.engine is not None:
            s = self.engine.stats
            self.peak, self.budget = s["peak_resident_bytes"], s["ram_budget_bytes"]
        r = BatchReport(
            total=self.total if self.total is not None else self.requests, skipped=self.skipped,
            requests=self.requests, failed=self.failed, prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated, wall_s=wall, tokens_per_s=self.generated / wall if wall > 0 else 0.0,
            bytes_read=bytes_read, bytes_per_generated_token=bytes_read / self.generated if self.generated else None,
            expert_hit_rate=hits / (hits + misses) if hits + misses else None, peak_resident_bytes=self.peak,
            ram_budget_bytes=self.budget, price_per_hour=self.price, workers=workers, retried=self.retries)
        if self.price is not None:
            cost = self.price * wall / 3600
            r.cost_per_million_generated = cost / self.generated * 1e6 if self.generated else None
            total = self.generated + self.prompt_tokens
            r.cost_per_million_tokens = cost / total * 1e6 if total else None
        return r

    def _io(self) -> tuple[int, int, int]:
        if self.engine_delta is not None:
            return self.engine_delta
        if self.engine is None:
            return 0, 0, 0
        now = _engine_counts(self.engine.stats)
        return now[0] - self.base[0], now[1] - self.base[1], now[2] - self.base[2]


def print_report(r: BatchReport, out: TextIO) -> None:
    lines = [
        "--- batch ---",
        f"requests:        {r.requests} this run ({r.failed} failed), {r.skipped + r.requests} of {r.total} done"
        + (f", {r.skipped} from an earlier run" if r.skipped else ""),
        f"tokens:          {r.prompt_tokens} prompt, {r.generated_tokens} generated",
        f"wall time:       {r.wall_s:.1f} s" + (f" on {r.workers} workers" if r.workers > 1 else ""),
        f"throughput:      {r.tokens_per_s:.1f} generated tokens/s (all sequences together)",
        f"bytes read:      {_per_token(r)} of experts per generated token, prefill included "
        f"({format_bytes(r.bytes_read)} in all)",
        "expert hit rate: " + (f"{100 * r.expert_hit_rate:.1f}%" if r.expert_hit_rate is not None else "n/a"),
        f"peak resident:   {_peak(r)}",
    ]
    if r.steps:
        lines.append(f"in flight:       up to {r.widest_step} sequences in one step, {r.steps} steps"
                     + _planned(r.batch_plan))
    if r.reassigned:
        lines.append(f"reassigned:      {r.reassigned} chunks of requests whose worker died ran on another")
    if r.retried:
        lines.append(f"retried:         {r.retried} requests found no room for their state beside the others and "
                     "ran later with fewer in flight (a smaller --max-batch avoids that)")
    if r.price_per_hour is not None:
        lines.append(f"cost:            {_money(r.cost_per_million_generated)} per million generated tokens, "
                     f"{_money(r.cost_per_million_tokens)} per million tokens in all (at {r.price_per_hour:g}/hour)")
    out.write("\n".join(lines) + "\n")
    out.flush()


def _per_token(r: BatchReport) -> str:
    if r.bytes_per_generated_token is None:
        return "n/a"
    return f"{format_bytes(r.bytes_per_generated_token)} ({r.bytes_per_generated_token:.0f} bytes)"


def _peak(r: BatchReport) -> str:
    if r.ram_budget_bytes is None:
        return f"{format_bytes(r.peak_resident_bytes)} (no --ram-budget set)"
    return (f"{format_bytes(r.peak_resident_bytes)} of the {format_bytes(r.ram_budget_bytes)} budget "
            f"({100 * r.peak_resident_bytes / r.ram_budget_bytes:.0f}%)" + (" per worker" if r.workers > 1 else ""))


def _planned(plan: dict | None) -> str:
    """What the state room allowed, for the first request's shape (prompt and max_tokens)."""
    if not plan or plan.get("state_bytes_per_sequence") is None or plan.get("state_room_bytes") is None:
        return ""
    return (f"; state room {format_bytes(plan['state_room_bytes'])} holds {plan['state_fits_sequences']} sequences "
            f"of the first request's shape at {format_bytes(plan['state_bytes_per_sequence'])} each")


def _money(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4g}"
