"""`moestream bench MODEL`: prefill and decode speed under a RAM budget, against the disk's own bandwidth.

Owns the benchmark run (optional cold page cache, a direct-I/O probe of the model's files, prefill, a decode
loop with per-token records), the per-phase breakdown (waiting on I/O, expert compute, attention/mixer, other),
the JSON report and an optional PNG of hit rate and tokens/s over the run (matplotlib, the `plot` extra). The engine is used as a library;
nothing here changes how it computes.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from moestream.cgroup import proc_kib, rss_now  # noqa: F401  (bench/batch_throughput.py imports rss_now here)
from moestream.cli.common import (DEFAULT_BUDGET_HELP, add_budget_arg, add_compute_dtype_arg, add_remote_args,
                                  add_state_room_arg, add_threads_arg)
from moestream.config import format_bytes, parse_bytes
from moestream.engine.sampling import draw
from moestream.errors import BudgetError, MoestreamError
from moestream.plot import pyplot
from moestream.experts.reader import IO_THREADS, align_down
from moestream.kernels.quant import bandwidth_probe
from moestream.weights.index import drop_file_pages

PROBE_CHUNK = 4 << 20
PROBE_SECONDS = 2.0
PROBE_THREADS = 8  # the probe asks the disk for its best at a deep queue, whatever depth the engine reads at
MEMORY_PROBE_BYTES = 256 << 20  # read by the memory bandwidth probe (best of three passes; 8x the LLC here)


# The stated fixed overhead: peak RSS stays within the budget plus the interpreter's own RSS before the engine opens
# plus this much for library code paged in later (measured 8-16 MiB on the medium synthetic model,
# docs/performance.md).
RSS_LIBRARY_ALLOWANCE = 32 << 20


@dataclass
class BenchOptions:
    ram_budget: int | None = None
    prompt_len: int = 64
    gen_len: int = 32
    cold: bool = False
    temperature: float = 0.0
    seed: int = 0
    threads: int | None = None  # torch compute threads (default: the engine's choice)
    io_threads: int = IO_THREADS
    policy: str = "lfru"
    lookahead: bool = True
    direct_io: bool = True
    probe: bool = True
    plot: Path | None = None
    state_room: int | None = None  # budget the residency plan keeps for state when dense weights stream
    lookahead_reads: int | None = None  # None: the engine's default number of read-ahead experts per layer step
    kv_dtype: str = "fp32"  # KV cache storage (EngineOptions.kv_dtype)
    compute_dtype: str = "fp32"  # many-row products' precision (EngineOptions.compute_dtype)


@dataclass
class TokenRecord:
    seconds: float
    bytes_read: int
    hits: int
    misses: int
    phases: dict = field(default_factory=dict)  # this token's share of the phase clocks (_token_phases)


@dataclass
class PhaseClock:
    """Wall time in the attention/mixer of every layer (wrapped from outside; the model is not changed). A mixer's
    native one-token layer (`decode_block`: attention and router, and the routed experts when all are resident) is
    wrapped too, and the model's native runs of every layer of a warm token (`decode_layers`, which finds each
    wrapped mixer by its `__wrapped__`), so the benchmark decodes by the path `run` and `serve` take, and their time
    counts here."""

    mixer_s: float = 0.0
    wrapped: list = field(default_factory=list)
    wrapped_model: Any = None  # the model whose decode_layers is wrapped

    def wrap(self, model, runner=None) -> bool:
        """Times every layer's mixer; `runner` (the engine's ExpertRunner): what it spends waiting on reads, in
        expert functions and in the lookahead inside `decode_layers` (a layer's experts that its table lacks run
        through it) is left out of the mixer's time, since the benchmark counts it apart."""
        layers = getattr(model, "layers", [])
        for layer in layers:
            fn = getattr(layer, "mixer", None)
            if fn is None:
                return False
            self.wrapped.append((layer, fn))
            timed = self._timed(fn)
            timed.__wrapped__ = fn  # type: ignore[attr-defined]
            block = getattr(fn, "decode_block", None)
            if block is not None:  # keep the native one-token layer the unwrapped model takes (models/base.py)
                timed.decode_block = self._timed(block)  # type: ignore[attr-defined]
            layer.mixer = timed
        if layers and hasattr(model, "decode_layers"):
            self.wrapped_model = model
            model.decode_layers = self._timed(model.decode_layers, runner)
        return bool(layers)

    def _timed(self, fn, runner=None):
        def counted() -> float:
            t = getattr(runner, "times", None)
            return t.io_wait_s + t.expert_s + t.lookahead_s if t is not None else 0.0

        def run(*a, **kw):
            t, apart = time.perf_counter(), counted()
            try:
                return fn(*a, **kw)
            finally:
                self.mixer_s += time.perf_counter() - t - (counted() - apart)
        return run

    def unwrap(self) -> None:
        for layer, fn in self.wrapped:
            layer.mixer = fn
        self.wrapped.clear()
        if self.wrapped_model is not None:
            del self.wrapped_model.decode_layers  # the class's method again
            self.wrapped_model = None


# ---- page cache and disk probe -------------------------------------------------------------------------
def model_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".safetensors")


def drop_page_cache(files: list[Path]) -> str:
    """Evict the model's files from the OS page cache (always permitted for files we can open)."""
    if not all([drop_file_pages(f) for f in files]):
        return "unsupported"
    return "fadvise_dontneed"


def probe_disk(files: list[Path], threads: int, seconds: float = PROBE_SECONDS, chunk: int = PROBE_CHUNK,
               seed: int = 0, buffers: int = 1) -> float:
    """Bytes/s of random, aligned O_DIRECT reads of `chunk` bytes from the model's own files on `threads` threads
    (buffered + page drop where O_DIRECT is refused), each thread reading into its `buffers` buffers in turn,
    written once before the clock starts. Reads never enter the page cache. On a VM a read's rate can depend on
    the memory it lands in (docs/plan.md, "Deep memory"): more buffers sample more of it."""
    from concurrent.futures import ThreadPoolExecutor

    sizes = [(f, f.stat().st_size) for f in files]
    chunk = min(chunk, align_down(max((s for _, s in sizes), default=0)))
    sizes = [(f, s) for f, s in sizes if s >= chunk]
    if chunk == 0:
        return 0.0
    rng = random.Random(seed)
    fds = {f: _open_probe(f) for f, _ in sizes}
    started = [0.0]
    ready = threading.Barrier(threads + 1, action=lambda: started.__setitem__(0, time.perf_counter()))

    def worker(_: int) -> int:
        # private anonymous memory, unmapped at the end: shared (shmem) pages would linger in the peak RSS
        try:
            bufs = [mmap.mmap(-1, chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(max(1, buffers))]
            for b in bufs:
                b[::mmap.PAGESIZE] = b"\1" * (chunk // mmap.PAGESIZE)  # faulted in before the clock starts
        except BaseException:
            ready.abort()  # the others (and the caller) stop waiting; the error comes out of result()
            raise
        ready.wait()
        got = n = 0
        while time.perf_counter() < started[0] + seconds:
            f, size = rng.choice(sizes)
            fd, direct = fds[f]
            off = align_down(rng.randrange(0, size - chunk + 1))
            got += os.preadv(fd, [bufs[n % len(bufs)]], off)
            n += 1
            if not direct:
                os.posix_fadvise(fd, off, chunk, os.POSIX_FADV_DONTNEED)
        return got

    try:
        with ThreadPoolExecutor(threads) as ex:
            futs = [ex.submit(worker, i) for i in range(threads)]
            try:
                ready.wait()
            except threading.BrokenBarrierError:
                pass
            total = sum(f.result() for f in futs)
    finally:
        for fd, _ in fds.values():
            os.close(fd)
    return total / (time.perf_counter() - started[0])


def probe_stream(files: list[Path], seconds: float = PROBE_SECONDS, seed: int = 0) -> float:
    """Bytes/s of streamed dense weights' read pattern (engine/residency.py: a head's slabs, and layers read into
    two kept slots): consecutive HEAD_SLAB_BYTES O_DIRECT reads from a random place in the model's largest shard,
    back to back, into two kept buffers on huge pages (faulted in before the clock starts). On a VM a direct read is cut into one disk request
    per physically contiguous stretch of its buffer, so this pattern and the random probe's (4 MiB into 4 KiB pages)
    read at different rates (docs/performance.md). 0.0 where no shard holds two slabs or O_DIRECT is refused."""
    from moestream.engine.residency import HEAD_SLAB_BYTES, read_direct
    from moestream.weights import pages

    slab = HEAD_SLAB_BYTES
    sizes = [(f, f.stat().st_size) for f in files]
    f, size = max(sizes, key=lambda fs: fs[1], default=(None, 0))
    if f is None or size < 2 * slab:
        return 0.0
    bufs = [pages.anon_buffer(slab) for _ in range(2)]
    for b in bufs:
        b[::mmap.PAGESIZE] = b"\1" * (slab // mmap.PAGESIZE)
    off = align_down(random.Random(seed).randrange(0, size - slab + 1))
    got, t0 = 0, time.perf_counter()
    while time.perf_counter() < t0 + seconds:
        if off + slab > size:
            off = 0
        if read_direct(f, off, slab, into=bufs[got // slab % 2]) is None:
            return 0.0
        got, off = got + slab, off + slab
    return got / (time.perf_counter() - t0)


def _open_probe(f: Path) -> tuple[int, bool]:
    try:
        return os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0)), hasattr(os, "O_DIRECT")
    except OSError:
        return os.open(f, os.O_RDONLY), False


def peak_rss() -> int:
    """This process image's peak RSS: VmHWM on Linux (getrusage's ru_maxrss also carries the RSS of a parent that
    forked us before exec, e.g. a 400 MB test runner), else ru_maxrss."""
    hwm = proc_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# ---- the run ---------------------------------------------------------------------------------------------
def bench(path: str | Path, opts: BenchOptions) -> dict:
    from moestream import Engine

    path = Path(path)
    if opts.plot is not None:
        pyplot()  # a missing matplotlib is said before the run, not after it
    files = model_files(path)
    cold = drop_page_cache(files) if opts.cold else "warm"
    # a virtual disk's bandwidth drifts by +-40% between seconds: probe before and after the run for the same time
    # each; the roofline uses their mean (the disk's average around the run) and the report keeps the better one
    probe_threads = max(PROBE_THREADS, opts.io_threads)
    probes = [probe_disk(files, probe_threads)] if opts.probe else []
    # before the engine opens: its buffer comes and goes while RSS is the interpreter's (a --cap run's group)
    mem_bw = bandwidth_probe(MEMORY_PROBE_BYTES) if opts.probe else 0.0
    base_rss = rss_now()
    room = bench_state_room(path, opts)
    eng = Engine.open(path, ram_budget=opts.ram_budget, cache_policy=opts.policy, io_threads=opts.io_threads,
                      threads=opts.threads, state_room=room, kv_dtype=opts.kv_dtype,
                      compute_dtype=opts.compute_dtype)
    try:
        _check_room(eng, room or 0)
        eng.runner.lookahead.enabled = opts.lookahead
        if opts.lookahead_reads is not None:
            eng.runner.lookahead.reads = opts.lookahead_reads
        eng.plan.store.reader.direct = opts.direct_io and eng.plan.store.reader.direct
        report = _run(eng, opts)
    finally:
        eng.runner.finish()
        eng.runner.save_heat()
        eng.close()
    peak = peak_rss()  # the engine's peak, before the second probe's own buffers
    if opts.probe:
        probes.append(probe_disk(files, probe_threads, seed=1))
        report["memory_bandwidth_bytes_per_s"] = mem_bw
        if report.get("streamed_dense_bytes_per_token"):  # the streamed dense bytes' own pattern
            report["disk_stream_bandwidth_bytes_per_s"] = probe_stream(files, seed=1)
    report.update(_context(eng, opts, cold, sum(probes) / len(probes) if probes else 0.0, base_rss, peak))
    report["disk_bandwidth_best_probe_bytes_per_s"] = max(probes, default=0.0)
    if opts.ram_budget is not None:
        report["rss_bound_bytes"] = opts.ram_budget + base_rss + RSS_LIBRARY_ALLOWANCE
        report["rss_within_bound"] = peak <= report["rss_bound_bytes"]
    report["disk_probes_bytes_per_s"] = probes
    finish_report(report)
    if opts.plot is not None:
        write_plot(report, opts.plot)
    return report


def bench_state_room(path: Path, opts: BenchOptions) -> int | None:
    """The budget the residency plan keeps for the benchmark's one sequence: --state-room when given, else the
    state that sequence reaches at prompt + generated tokens (as `moestream plan` sizes it). Without it a small
    budget opens (the engine's default keeps no state room) and then fails mid-prefill when the state has taken
    the expert cache's room; with it `Engine.open` streams enough dense weights, or refuses the budget up front
    naming the state room."""
    if opts.state_room is not None or opts.ram_budget is None:
        return opts.state_room
    from moestream.config import EngineOptions
    from moestream.engine.engine import model_config
    from moestream.planner.state import state_shape

    shape = state_shape(model_config(path)[1], opts.kv_dtype)  # config.json alone: Engine.open reads the headers
    return shape.at(opts.prompt_len, opts.prompt_len + opts.gen_len, EngineOptions().prefill_chunk)


def _check_room(eng, room: int) -> None:
    """What the build keeps (the family's derived tensors too, which the residency plan does not see) leaves the
    state room and one expert: else the run would stop mid-prefill when the state has taken the cache's room."""
    m = eng.memory
    one = eng.plan.max_expert_bytes
    if room and m.limited and m.cache_capacity() < room + one:
        raise BudgetError(
            f"--ram-budget {format_bytes(m.budget)} ({m.budget} bytes) leaves {format_bytes(m.cache_capacity())} "
            f"after the dense weights, stream buffers and scratch: less than the state room "
            f"{format_bytes(room)} (this run's sequence at --prompt-len + --gen-len tokens) + one expert "
            f"{format_bytes(one)}; raise --ram-budget by {room + one - m.cache_capacity()} bytes "
            "or shorten the run")


def _run(eng, opts: BenchOptions) -> dict:
    gen = torch.Generator().manual_seed(opts.seed)
    prompt = torch.randint(0, eng.vocab_size, (opts.prompt_len,), generator=gen).tolist()
    clock = PhaseClock()
    timed = clock.wrap(eng.model, eng.runner)
    state = eng.new_sequence()
    try:
        t0 = time.perf_counter()
        logits = eng.prefill(state, prompt)
        tok = _pick(logits, opts.temperature, gen)
        ttft = time.perf_counter() - t0
        start = _snapshot(eng, clock)
        records, tokens = [], [tok]
        for _ in range(opts.gen_len):
            before, p0 = _counters(eng), _token_phases(eng, clock)
            t = time.perf_counter()
            (logits,) = eng.step([(state, [tok])])
            tok = _pick(logits, opts.temperature, gen)
            tokens.append(tok)
            after, p1 = _counters(eng), _token_phases(eng, clock)
            records.append(TokenRecord(time.perf_counter() - t, after[0] - before[0], after[1] - before[1],
                                       after[2] - before[2], {k: p1[k] - p0[k] for k in p0}))
        end = _snapshot(eng, clock)
    finally:
        clock.unwrap()
        eng.free(state)
    return {**_summarise(eng, opts, records, ttft, start, end, timed), "generated_ids": tokens[:opts.gen_len]}


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return draw(torch.softmax(logits.float() / temperature, dim=-1), gen)


def _counters(eng) -> tuple[int, int, int]:
    s = eng.runner.cache.stats
    return eng.plan.store.bytes_read, s.hits, s.misses


def _token_phases(eng, clock: PhaseClock) -> dict:
    """The phase clocks and step counters one token's record takes the difference of: seconds waiting on reads,
    in expert steps, in the lookahead, in the mixers (with the native one-token layer's experts), the disk busy,
    and the MoE layer steps, of which warm (the one-token path with every expert cached and nothing in flight)."""
    t = eng.runner.times
    return {"io_wait_s": t.io_wait_s, "expert_s": t.expert_s, "lookahead_s": t.lookahead_s, "mixer_s": clock.mixer_s,
            "disk_busy_s": eng.plan.store.reader.stats.busy_s, "layer_steps": t.steps, "warm_steps": t.resident_steps,
            "prefetch_reads": t.prefetch_reads}


def _snapshot(eng, clock: PhaseClock) -> dict:
    t, io = eng.runner.times, eng.plan.store.reader.stats
    return {"io_wait": t.io_wait_s, "expert": t.expert_s, "lookahead": t.lookahead_s, "mixer": clock.mixer_s,
            "busy": io.busy_s, "bytes": io.bytes_read, "layer_hits": dict(eng.runner.cache.stats.layer_hits),
            "layer_misses": dict(eng.runner.cache.stats.layer_misses), "prefetch_reads": t.prefetch_reads,
            "prefetch_used": t.prefetch_used, "prefetch_withdrawn": t.prefetch_withdrawn,
            "streamed": eng.memory.streamer.bytes_read if eng.memory.streamer is not None else 0,
            "wall": time.perf_counter()}


def _summarise(eng, opts: BenchOptions, records: list[TokenRecord], ttft: float, a: dict, b: dict,
               timed: bool) -> dict:
    n = max(1, len(records))
    decode_s = sum(r.seconds for r in records) or 1e-9
    hits, misses = sum(r.hits for r in records), sum(r.misses for r in records)
    nbytes = b["bytes"] - a["bytes"]
    d = {k: b[k] - a[k] for k in ("io_wait", "expert", "lookahead", "mixer", "busy")}
    phases = {"io_wait_s": d["io_wait"], "expert_compute_s": d["expert"],
              "attention_mixer_s": d["mixer"] if timed else None,
              "other_s": decode_s - d["io_wait"] - d["expert"] - (d["mixer"] if timed else 0.0)}
    layers = sorted(set(b["layer_hits"]) | set(b["layer_misses"]))
    layer_rates = {}
    for layer in layers:
        h = b["layer_hits"].get(layer, 0) - a["layer_hits"].get(layer, 0)
        m = b["layer_misses"].get(layer, 0) - a["layer_misses"].get(layer, 0)
        layer_rates[str(layer)] = round(h / (h + m), 4) if h + m else None
    return {
        "decode_tokens_per_s": len(records) / decode_s,
        "prefill_tokens_per_s": opts.prompt_len / ttft if ttft > 0 else 0.0,
        "ttft_s": ttft,
        "bytes_read_per_token": nbytes / n,
        "streamed_dense_bytes_per_token": (b["streamed"] - a["streamed"]) / n,
        # RAM a token reads: the resident dense weights (all but the embedding table, of which it reads one row)
        # and its cached experts
        "resident_bytes_per_token": _resident_dense_bytes(eng) + hits / n * _mean_expert_bytes(eng),
        "expert_hit_rate": hits / max(1, hits + misses),
        "read_bandwidth_bytes_per_s": nbytes / d["busy"] if d["busy"] > 0 else 0.0,
        "disk_busy_fraction": d["busy"] / decode_s,  # share of decode time with at least one read in flight
        "decode_phases_s": phases,
        "layer_hit_rates": layer_rates,
        "prefetch": {"reads": b["prefetch_reads"] - a["prefetch_reads"],
                     "used": b["prefetch_used"] - a["prefetch_used"],
                     "withdrawn": b["prefetch_withdrawn"] - a["prefetch_withdrawn"],
                     "gates": eng.runner.lookahead.report()},
        "per_token": [{"s": round(r.seconds, 5), "bytes": r.bytes_read, "misses": r.misses,
                       "hit_rate": round(r.hits / max(1, r.hits + r.misses), 4),
                       **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.phases.items()}}
                      for r in records],
    }


def _resident_dense_bytes(eng) -> int:
    table = getattr(eng.model, "embed_tokens", None)
    streamer = eng.memory.streamer
    embed_resident = table is not None and (streamer is None or not streamer.plan.embed_streamed)
    return eng.memory.dense_bytes - (table.numel() * table.element_size() if embed_resident else 0)


def _mean_expert_bytes(eng) -> float:
    count = len(eng.plan.layout.moe_layers) * eng.plan.layout.num_experts
    return eng.plan.expert_bytes / max(1, count)


def _context(eng, opts: BenchOptions, cold: str, disk_bw: float, base_rss: int, peak: int) -> dict:
    s = eng.stats
    return {"model": str(eng.path), "ram_budget_bytes": s["ram_budget_bytes"], "peak_rss_bytes": peak,
           "interpreter_rss_bytes": base_rss, "peak_accounted_bytes": s["peak_resident_bytes"],
           "dense_bytes": s["dense_bytes"], "expert_bytes_total": eng.plan.expert_bytes,
           "disk_bandwidth_bytes_per_s": disk_bw, "page_cache": cold, "policy": opts.policy,
           "lookahead": opts.lookahead, "direct_io": eng.plan.store.reader.direct,
           "compute_threads": torch.get_num_threads(), "io_threads": opts.io_threads,
           "prompt_len": opts.prompt_len, "gen_len": opts.gen_len, "temperature": opts.temperature,
           "compute_dtype": eng.options.compute_dtype}


def finish_report(r: dict) -> dict:
    """Derived figures: io_roofline_fraction = (bytes per token / disk bandwidth) / seconds per token, against the
    probes' mean and (io_roofline_fraction_best_probe) against the faster probe; every_byte_roofline_fraction =
    (expert bytes at the disk bandwidth, streamed dense bytes at the stream probe's (probe_stream, where it ran) +
    resident dense and cached expert bytes at the memory bandwidth, no overlap credited) / seconds per token (issue
    #12's K3 roofline)."""
    per_tok = 1.0 / r["decode_tokens_per_s"] if r["decode_tokens_per_s"] > 0 else 0.0
    for key, bw_key in (("io_roofline_fraction", "disk_bandwidth_bytes_per_s"),
                        ("io_roofline_fraction_best_probe", "disk_bandwidth_best_probe_bytes_per_s")):
        bw = r.get(bw_key) or 0.0
        r[key] = (r["bytes_read_per_token"] / bw) / per_tok if bw > 0 and per_tok > 0 else None
    disk, mem = r.get("disk_bandwidth_bytes_per_s") or 0.0, r.get("memory_bandwidth_bytes_per_s") or 0.0
    stream = r.get("disk_stream_bandwidth_bytes_per_s") or disk
    if disk > 0 and mem > 0 and per_tok > 0:
        roof_s = (r["bytes_read_per_token"] / disk + r.get("streamed_dense_bytes_per_token", 0.0) / stream
                  + r.get("resident_bytes_per_token", 0.0) / mem)
        r["every_byte_roofline_tokens_per_s"] = 1.0 / roof_s if roof_s > 0 else None
        r["every_byte_roofline_fraction"] = roof_s / per_tok
    else:
        r["every_byte_roofline_tokens_per_s"] = r["every_byte_roofline_fraction"] = None
    return r


# ---- output ----------------------------------------------------------------------------------------------
def format_report(r: dict) -> str:
    ph, dec = r["decode_phases_s"], r["gen_len"] / max(r["decode_tokens_per_s"], 1e-12)
    lines = [
        f"model            {r['model']}",
        f"ram budget       {_fmt(r['ram_budget_bytes'])}   experts {format_bytes(r['expert_bytes_total'])}   "
        f"dense {format_bytes(r['dense_bytes'])}   page cache: {r['page_cache']}",
        f"prefill          {r['prefill_tokens_per_s']:.2f} tok/s   ttft {r['ttft_s']:.3f} s ({r['prompt_len']} tokens)",
        f"decode           {r['decode_tokens_per_s']:.3f} tok/s   ({r['gen_len']} tokens)",
        f"expert hit rate  {r['expert_hit_rate']:.3f}   read {format_bytes(r['bytes_read_per_token'])}/token",
        f"read bandwidth   {format_bytes(r['read_bandwidth_bytes_per_s'])}/s while reading, "
        f"{_pct(r['disk_busy_fraction'])} of decode;   disk probe "
        + (f"{format_bytes(r['disk_bandwidth_bytes_per_s'])}/s (direct I/O, mean of before and after; better one "
           f"{format_bytes(int(r['disk_bandwidth_best_probe_bytes_per_s']))}/s)"
           if r.get("disk_bandwidth_best_probe_bytes_per_s") else "skipped (--no-probe)")
        + (f";   stream probe {format_bytes(int(r['disk_stream_bandwidth_bytes_per_s']))}/s (streamed dense "
           f"weights)" if r.get("disk_stream_bandwidth_bytes_per_s") else ""),
        f"I/O roofline     {_pct(r['io_roofline_fraction'])} of decode time is the disk at full speed "
        f"({_pct(r.get('io_roofline_fraction_best_probe'))} against the better probe)",
        f"every-byte roof  {_pct(r.get('every_byte_roofline_fraction'))} (disk bytes at the probes', RAM bytes at "
        f"the memory's bandwidth: {r.get('every_byte_roofline_tokens_per_s') or 0:.2f} tok/s)",
        f"peak RSS         {format_bytes(r['peak_rss_bytes'])} (interpreter and libraries "
        f"{format_bytes(r['interpreter_rss_bytes'])}; accounted peak {format_bytes(r['peak_accounted_bytes'])})"
        + (f"; bound budget + interpreter + {format_bytes(RSS_LIBRARY_ALLOWANCE)}: "
           f"{'within' if r['rss_within_bound'] else 'EXCEEDED'}" if "rss_bound_bytes" in r else ""),
        "decode phases    " + "   ".join(f"{k[:-2].replace('_', ' ')} {_share(v, dec)}" for k, v in ph.items()),
    ]
    pf = r["prefetch"]
    if pf["gates"]:
        on = sum(1 for g in pf["gates"].values() if g["on"])
        recall = sum(g["lifetime_recall"] for g in pf["gates"].values()) / len(pf["gates"])
        lines.append(f"lookahead        {on}/{len(pf['gates'])} layers on, mean recall {recall:.2f}, "
                     f"{pf['reads']} read ahead, {pf['used']} used")
    return "\n".join(lines)


def _fmt(n: int | None) -> str:
    return "unlimited" if n is None else format_bytes(n)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _share(v: float | None, total: float) -> str:
    return "n/a" if v is None else f"{v:.2f}s ({100 * v / max(total, 1e-12):.0f}%)"


def write_plot(r: dict, out: Path) -> None:
    """Hit rate and tokens/s per decoded token (matplotlib, the `plot` extra)."""
    toks = r["per_token"]
    hit = [t["hit_rate"] for t in toks]
    tps = [1.0 / t["s"] if t["s"] > 0 else 0.0 for t in toks]
    plt = pyplot()
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    a.plot(hit), a.set_ylabel("expert hit rate"), a.set_ylim(0, 1)
    b.plot(tps), b.set_ylabel("tokens/s"), b.set_xlabel("decoded token")
    fig.suptitle(f"{Path(r['model']).name}, budget {_fmt(r['ram_budget_bytes'])}")
    fig.savefig(out, dpi=100)
    plt.close(fig)


# ---- command line ----------------------------------------------------------------------------------------
def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="measure prefill/decode speed under a RAM budget against the disk's bandwidth",
                       description=__doc__)
    p.add_argument("model", help="checkpoint directory, hf://ORG/NAME[@REV] or https://.../DIR/")
    add_budget_arg(p, DEFAULT_BUDGET_HELP)
    add_remote_args(p)
    add_state_room_arg(p)
    add_compute_dtype_arg(p)
    p.add_argument("--prompt-len", type=int, default=64,
                   help="prompt tokens (random ids; default 64); without --state-room the run keeps room for its "
                        "sequence's state at --prompt-len + --gen-len tokens")
    p.add_argument("--gen-len", type=int, default=32, help="decoded tokens (default 32)")
    p.add_argument("--cold", action="store_true", help="evict the model's files from the page cache first")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); random-weight models loop on one token under greedy, so use 1.0 "
                        "there for realistic routing")
    p.add_argument("--seed", type=int, default=0)
    add_threads_arg(p)
    p.add_argument("--io-threads", type=int, default=IO_THREADS, help=f"reads in flight (default {IO_THREADS})")
    p.add_argument("--policy", default="lfru", help="expert cache policy: lfru (default), lru, heat")
    p.add_argument("--no-lookahead", dest="lookahead", action="store_false",
                   help="do not read the next MoE layer's experts ahead. Router lookahead (on by default, every "
                        "family) runs the next MoE layer's own router on this layer's router input; a layer's "
                        "reads are issued only while that prediction's recall (EMA) is at least 0.5")
    p.add_argument("--lookahead-reads", type=int, default=None, metavar="N",
                   help="predicted, not resident experts each layer step reads ahead, best first, where the "
                        "layer's recall gate is open (default 1)")
    p.add_argument("--buffered-io", action="store_true", help="buffered reads + page drop instead of O_DIRECT")
    p.add_argument("--no-probe", action="store_true", help="skip the direct-I/O disk bandwidth probe")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write hit rate and tokens/s per token")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of text")
    p.add_argument("--cap", nargs="?", const="512MiB", default=None, metavar="ALLOWANCE",
                   help="run the benchmark in a child process under a kernel memory limit (cgroup) of --ram-budget + "
                        "this process's RSS + ALLOWANCE (default 512MiB), page cache included; reports the peak, "
                        "times the limit was hit and any OOM kill")
    p.set_defaults(func=run_bench)
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    from moestream.experts.policies import POLICIES

    budget = parse_bytes(args.ram_budget)
    if budget is not None and budget <= 0:
        raise MoestreamError(f"--ram-budget must be positive, got {args.ram_budget!r}")
    if args.policy not in POLICIES:
        raise MoestreamError(f"unknown --policy {args.policy!r}; choose from {', '.join(POLICIES)}")
    if args.prompt_len < 1 or args.gen_len < 1:
        raise MoestreamError("--prompt-len and --gen-len must be at least 1")
    return BenchOptions(budget, args.prompt_len, args.gen_len, args.cold, args.temperature, args.seed,
                        args.threads, args.io_threads, args.policy, args.lookahead, not args.buffered_io,
                        not args.no_probe, args.plot, parse_bytes(args.state_room), args.lookahead_reads,
                        args.kv_dtype, args.compute_dtype)


def run_bench(args: argparse.Namespace) -> int:
    from moestream.cli.common import model_dir, resolve_budget

    path = model_dir(args.model)  # a remote spec becomes its stub; its shards then read over HTTP + SSD tier
    opts = options_from_args(args)
    if opts.ram_budget is None and args.cap is None:  # no budget: none where the model fits, else a share of RAM
        opts = replace(opts, ram_budget=resolve_budget(None, path, args.state_room))
    if args.cap is not None:
        return _run_capped(path, opts, args.cap, args.json)
    report = bench(path, opts)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0


# ---- under a kernel memory cap (--cap): the run in a child process inside a cgroup -----------------------------
def bench_in_cgroup(path: str | Path, opts: BenchOptions, cap: int | None, timeout: float | None = None):
    """(the child's report or None, the CappedRun) for `bench(path, opts)` in a fresh memory cgroup limited to
    `cap` bytes (None: no limit, the group only measures)."""
    from dataclasses import asdict

    from moestream.cgroup import run_capped

    payload = json.dumps({"path": str(path), "opts": {k: (str(v) if isinstance(v, Path) else v)
                                                      for k, v in asdict(opts).items()}})
    run = run_capped([sys.executable, "-m", "moestream.bench", payload], cap, "bench", timeout=timeout)
    return (json.loads(run.stdout) if run.returncode == 0 and run.stdout.strip() else None), run


def _run_capped(path: Path, opts: BenchOptions, allowance: str, as_json: bool) -> int:
    from moestream.cgroup import cap_for

    if opts.ram_budget is None:
        raise MoestreamError("--cap needs --ram-budget: the kernel limit is the budget + this process's RSS + "
                             "the allowance")
    cap = cap_for(opts.ram_budget, rss_now(), parse_bytes(allowance))
    report, run = bench_in_cgroup(path, opts, cap)
    if report is None:
        what = "was OOM-killed by the kernel" if run.oom_killed else f"failed (exit status {run.returncode})"
        raise MoestreamError(f"the capped benchmark {what}\n{run.describe()}\n{run.stderr.strip()[-1500:]}")
    report["cgroup"] = run.summary()
    print(json.dumps(report, indent=1) if as_json else format_report(report) + "\n" + run.describe())
    return 0


def _child(payload: str) -> None:
    """`python -m moestream.bench PAYLOAD`: the capped child; prints its JSON report."""
    from moestream.cgroup import watch_peak

    watch_peak()
    spec = json.loads(payload)
    opts = spec["opts"]
    opts["plot"] = Path(opts["plot"]) if opts["plot"] else None
    try:
        print(json.dumps(bench(spec["path"], BenchOptions(**opts))))
    except MoestreamError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    _child(sys.argv[1])
