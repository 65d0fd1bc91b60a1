"""/metrics through prometheus-client: the scheduler's counters and gauges, latency histograms, errors by status.

Owns one registry per server (tests run several servers in one process), a collector that turns the scheduler's
`snapshot()` into the long-standing `moestream_*` series at scrape time, and the histograms the scheduler feeds
through its `observe(what, seconds)` hook (time to first token, inter-token latency, queue wait, duration).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

SNAPSHOT = [  # (name, type, help, snapshot key)
    ("moestream_requests_total", "counter", "Requests admitted.", "requests"),
    ("moestream_requests_failed_total", "counter", "Requests that ended in an error.", "failed"),
    ("moestream_requests_cancelled_total", "counter", "Requests cancelled by a client disconnect.", "cancelled"),
    ("moestream_tokens_generated_total", "counter", "Tokens generated.", "tokens_generated"),
    ("moestream_prompt_tokens_total", "counter", "Prompt tokens received.", "prompt_tokens"),
    ("moestream_prompt_tokens_reused_total", "counter", "Prompt tokens served from saved prefixes.",
     "prompt_tokens_reused"),
    ("moestream_engine_steps_total", "counter", "Engine steps (one forward over all active sequences).", "steps"),
    ("moestream_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.", "tokens_per_second"),
    ("moestream_expert_hit_rate", "gauge", "Routed-expert cache hit rate since start.", "expert_hit_rate"),
    ("moestream_expert_hits_total", "counter", "Routed-expert lookups served from the cache.", "expert_hits"),
    ("moestream_expert_misses_total", "counter", "Routed-expert lookups read from the checkpoint.", "expert_misses"),
    ("moestream_expert_bytes_read_total", "counter", "Expert bytes read from the checkpoint.", "bytes_read"),
    ("moestream_queue_depth", "gauge", "Requests waiting to be admitted.", "queue_depth"),
    ("moestream_active_sequences", "gauge", "Sequences being prefilled or decoded.", "active_sequences"),
    ("moestream_resident_bytes", "gauge", "Bytes resident under the RAM budget.", "resident_bytes"),
    ("moestream_state_bytes", "gauge", "Bytes of sequence state (KV caches, saved prefixes).", "state_bytes"),
    ("moestream_prefix_cache_bytes", "gauge", "Bytes held by saved prefixes.", "prefix_cache_bytes"),
    ("moestream_expert_cache_bytes", "gauge", "Bytes of routed experts in the cache.", "cache_bytes"),
]

# Seconds; from a few ms (one decode step of a small model) to minutes (a long generation under a tight budget).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

HISTOGRAMS = {  # observe() key -> (name, help)
    "ttft": ("moestream_time_to_first_token_seconds", "From submission to the first sampled token."),
    "itl": ("moestream_inter_token_latency_seconds", "Between two sampled tokens of one request."),
    "queue_wait": ("moestream_queue_wait_seconds", "From submission to admission into the batch."),
    "duration": ("moestream_request_duration_seconds", "From submission to the end of generation."),
}


class _Snapshot(Collector):
    """The scheduler's plain numbers, read at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        for name, kind, help_text, key in SNAPSHOT:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_text, value=float(snap.get(key) or 0))


class ServerMetrics:
    """The server's registry: snapshot series, latency histograms and an error counter labelled by status."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Snapshot(snapshot))
        self.histograms = {key: Histogram(name, help_text, registry=self.registry, buckets=LATENCY_BUCKETS)
                           for key, (name, help_text) in HISTOGRAMS.items()}
        self.errors = Counter("moestream_errors", "Error answers sent, by HTTP status.", ["status"],
                              registry=self.registry)

    def observe(self, what: str, seconds: float) -> None:
        """The scheduler's timing hook (called from its thread; prometheus-client metrics are thread-safe)."""
        self.histograms[what].observe(max(0.0, seconds))

    def error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
