"""Calibration: the rates of this machine the planner's model multiplies by, measured in a few seconds, cached.

Owns the probes (the disk by bench's direct-I/O probe, the one-row weight kernels the engine's decode takes per
weight format, the multi-row path's fp32 expansion, the fp32 GEMM rate, memory read bandwidth, and the engine's
fixed cost per layer step measured on a tiny synthetic checkpoint of the family; the kernel and memory probes
stream distinct buffers past the last-level cache, `stream_bytes()`, as a decode token streams its weights) and
their cache, a JSON file
under the user cache directory keyed by CPU (and, for the disk, by the filesystem's device), so that repeated
plans are instant; `--recalibrate` (alias `--calibrate`) measures again. Each rate is the median of ROUNDS
separate probes (each itself the median of short bursts), and the spread of the rounds is kept beside it, so that
a calibration taken while something else ran shows it.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moestream import __version__
from moestream.cgroup import memory_available
from moestream.config import default_cache_dir
from moestream.weights import pages

KINDS = ("bf16", "mxfp4", "fp8", "int4", "f32")
MXFP4_BF16 = "mxfp4_bf16"  # MXFP4 weights' probe under --compute-dtype bf16 (blocks.mxfp4_bf16: rounded activations)
PROBES_VERSION = 11  # part of the cache key: a change to what a probe measures measures again
ROUNDS = 3  # separate probes per rate; the median is kept (a burst of load costs one round, not the rate)
PROBE_FILE_BYTES = 256 << 20  # written once where the weights would live when the model has no local shards
BURST_S = 0.15
DEEP_PROBE_BYTES = 8 << 30  # fresh memory the deep-memory probe may hold (at most half of what is available)
DEEP_PROBE_S = 4.0
DISK_PROBE_BUFFERS = 4  # per probe thread: 32 buffers of 4 MiB over the probe's 8 threads
DEEP_AFTER = 8  # slow chunks timed past the first


@dataclass
class Overhead:
    """The engine's fixed wall time per layer step beyond bytes and FLOPs (Python, dispatch, small ops), measured on
    a tiny checkpoint whose weights cost nothing: decode_s + decode_row_s x rows per decode step, prefill_s per
    prefill chunk."""

    decode_s: float
    decode_row_s: float
    prefill_s: float
    source: str = ""
    miss_s: float = 0.0  # engine CPU per expert read on a miss beyond a hit's (land, one-expert apply, evict)
    # a one-token layer step off the warm path (a miss, or a read in flight: ExpertRunner.run's general path, the
    # experts apart from the native decode layer, the lookahead router) beyond the warm step, per layer step
    general_s: float = 0.0
    lookahead_s: float = 0.0  # the lookahead router and its queueing, per layer step (runner.times.lookahead_s)
    # a multi-row decode step (a batch) per layer step: batch_s + batch_row_s x rows, from steps of 8 and
    # BATCH_ROWS rows less their dense weights, in fp32 compute; both 0: not measured (decode_s + decode_row_s x
    # (rows - 1))
    batch_s: float = 0.0
    batch_row_s: float = 0.0
    # the same in bf16 compute (--compute-dtype bf16); both 0: not measured (the fp32 line)
    batch_bf16_s: float = 0.0
    batch_bf16_row_s: float = 0.0

    def batch_line(self, compute: str = "fp32") -> tuple[float, float]:
        """(fixed s, s per row) of a multi-row step's layer step in `compute`: (0, 0) where not measured."""
        if compute == "bf16" and (self.batch_bf16_s or self.batch_bf16_row_s):
            return self.batch_bf16_s, self.batch_bf16_row_s
        return self.batch_s, self.batch_row_s


@dataclass
class Rates:
    """What the planner assumes this machine does (every field is stated in its output)."""

    gemv: dict[str, float]  # weight bytes/s of one activation row through the engine's kernel, per format
    expand: dict[str, float]  # stored weight bytes/s expanded to fp32 for a multi-row GEMM, per format
    gemm_flops: float  # fp32 torch.mm FLOP/s (multi-row experts and dense layers)
    memory: float  # fp32 bytes/s read (KV rows, recurrent state)
    disk: float = 0.0  # expert and streamed-dense reads, bytes/s
    overhead: dict[str, Overhead] = field(default_factory=dict)  # per overhead_key (family, top-k)
    page_faults: float = 0.0  # bytes/s of fresh anonymous pages faulted in (zeroed by the kernel): a read buffer
    # fresh memory a process takes at that rate (the deep-memory probe's total: freed, the next process's hot
    # memory; a VM's host takes pages back once the guest frees them: docs/plan.md, "Deep memory"), and the rate
    # of fresh pages beyond it; 0 / 0: no slowdown seen within the probe
    hot_bytes: float = 0.0
    deep_faults: float = 0.0
    # bytes/s of one row through a layer's top_k bf16 GLU experts in one fused native call (fused.moe_glu_bf16, the
    # engine's decode path for them: no Python per matrix); 0: not measured, the one-row kernel's rate is used
    glu: float = 0.0
    # seconds per expert of the same fused call over many rows (the panel kernel a batch step runs): "group" (a
    # layer step's resident experts in one call) and "single" (a read expert's own call as it lands), each
    # {rows: seconds per expert}; empty: not measured, a multi-row expert is priced as fp32 expansion + GEMM
    glu_rows: dict[str, dict[str, float]] = field(default_factory=dict)
    # seconds per call of blocks.linear over R rows, per dense bf16 weight shape ("bf16 OUTxIN") and compute
    # precision: {shape: {"fp32": {rows: s}, "bf16": {rows: s}}} ("bf16": from BF16_MIN_ROWS rows, under
    # --compute-dtype bf16); empty: not measured, dense weights priced by the one-row rate and fp32 expansion
    dense_rows: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # the KV / latent cache's storage work beyond fp32's, per --kv-dtype (quantise on write, dequantise on read):
    # {kv_dtype: {"decode_s", "decode_row_s", "batch_s", "batch_row_s", "prefill_token_s"}} seconds per layer with
    # a cache (per sequence; "_row_s": per token of context); empty: not measured (priced as fp32's)
    kv: dict[str, dict[str, float]] = field(default_factory=dict)
    # bytes/s of streamed dense reads (bench.probe_stream: 64 MiB O_DIRECT reads back to back into two kept
    # huge-page buffers, as DenseStreamer reads a head's slabs and its layers); 0: not measured, the disk rate is used
    disk_stream: float = 0.0

    def overhead_for(self, model_type: str, top_k: int, widths: dict[str, int] | None = None) -> Overhead | None:
        """The family's overhead at this top-k and these widths, else at this top-k, else the family's, else any
        measured one."""
        o = self.overhead
        return (o.get(overhead_key(model_type, top_k, widths)) or o.get(overhead_key(model_type, top_k))
                or o.get(model_type) or next(iter(o.values()), None))
    source: dict[str, str] = field(default_factory=dict)  # what each rate came from

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Rates":
        out = cls(dict(d["gemv"]), dict(d["expand"]), float(d["gemm_flops"]), float(d["memory"]),
                  float(d.get("disk", 0.0)), {}, float(d.get("page_faults", 0.0)), float(d.get("hot_bytes", 0.0)),
                  float(d.get("deep_faults", 0.0)), float(d.get("glu", 0.0)), source=dict(d.get("source", {})))
        out.glu_rows = {k: {str(r): float(t) for r, t in v.items()} for k, v in (d.get("glu_rows") or {}).items()}
        out.dense_rows = {shape: {c: {str(r): float(t) for r, t in v.items()} for c, v in by.items()}
                          for shape, by in (d.get("dense_rows") or {}).items()}
        out.kv = {k: {n: float(t) for n, t in v.items()} for k, v in (d.get("kv") or {}).items()}
        out.disk_stream = float(d.get("disk_stream", 0.0))
        out.overhead = {k: Overhead(**v) for k, v in d.get("overhead", {}).items()}
        return out


# ---- the cache ------------------------------------------------------------------------------------------------
def machine_key() -> str:
    """CPU model, core count, compute threads, native SIMD level, the native library's build (its sources, flags
    and CPU: a changed kernel has other rates) and moestream version: a change in any of them measures again."""
    from moestream.kernels import cpu

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((l.split(":", 1)[1].strip() for l in fh if l.startswith("model name")), model)
    except OSError:
        pass
    built = cpu.loaded_path()
    simd = f"{cpu.simd()} {built.stem}" if built is not None else "torch"
    return (f"{model}|{os.cpu_count()} cpus|{torch.get_num_threads()} threads|{simd}|moestream {__version__}"
            f"|probes {PROBES_VERSION}")


CACHE_ENV = "MOESTREAM_PLAN_CALIBRATION"  # a calibration file of its own (bench/plan_accuracy.py: one per run)


def cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or default_cache_dir() / "plan-calibration.json")


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save(data: dict) -> None:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def disk_key(where: Path) -> str:
    return f"dev {os.stat(where).st_dev}"


# ---- probes ---------------------------------------------------------------------------------------------------
def _rate(work: Callable[[], None], units: float, seconds: float) -> float:
    """units/s of `work`: the median of short bursts over `seconds` (a loaded machine: typical, not best)."""
    work()
    rates, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(rates) < 2:
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < BURST_S / 3 or n == 0:
            work()
            n += 1
        rates.append(n * units / (time.perf_counter() - t))
    return statistics.median(rates)


def rounds(probe: Callable[[], float | tuple[float, ...]], n: int = ROUNDS) -> tuple[list[float], str]:
    """Run `probe` `n` times: (the median of each of its values, "rounds: min-max" spread of the first value)."""
    got = [probe() for _ in range(max(1, n))]
    rows = [g if isinstance(g, tuple) else (g,) for g in got]
    med = [statistics.median(col) for col in zip(*rows)]
    first = [r[0] for r in rows]
    return med, f"median of {len(rows)} rounds (spread {min(first):.4g}-{max(first):.4g})"


def _resident_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in the memory a resident dense weight of the engine is loaded into (weights.pages.weight_bytes:
    huge pages for its whole 2 MiB stretches; weights/index.py), so that a probe of dense weights streams what the
    engine's decode streams (a 512 MiB bf16 GEMV here: 42.2 against 38.9 GB/s on 4 KiB pages, docs/plan.md)."""
    raw = torch.frombuffer(pages.weight_bytes(t.numel() * t.element_size()), dtype=torch.uint8)
    return raw.view(t.dtype).view(t.shape).copy_(t)


def _weights(kind: str, out: int, inp: int, nbytes: int, resident: bool = False) -> tuple[list, int, Callable,
                                                                                         Callable]:
    """Weight matrices of one format in distinct buffers, as many as make `nbytes` stored bytes (at least 2):
    (weights, their stored bytes, the engine's linear fn(x, w), its expansion to fp32 fn(w) as a multi-row step does
    before its GEMM). One matrix is made and copied: the probes time bytes streamed, not values. `resident`: the
    copies sit where the engine keeps a resident dense weight (_resident_copy); else in torch's own memory (a read
    expert's buffer is plain pages too)."""
    from moestream.kernels import quant
    from moestream.models.blocks import linear

    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(out, inp, generator=gen) * 0.02
    one = torch.ones(1, inp)
    if kind in ("bf16", "f32"):
        w0 = dense.to(torch.bfloat16 if kind == "bf16" else torch.float32)
        scratch = torch.empty(out, inp)  # the engine expands into a reused fp32 scratch (no fresh pages)
        fn, expand = linear, scratch.copy_
    elif kind in ("mxfp4", MXFP4_BF16):
        w0 = quant.quantize_mxfp4(dense)
        bf16 = kind == MXFP4_BF16  # the call under --compute-dtype bf16: activations rounded to bf16
        fn = lambda x, w: quant.mxfp4_linear(x, *w, bf16=bf16)  # noqa: E731
        expand = lambda w: quant.mxfp4_linear(one, *w, native=False)  # noqa: E731  # decoded chunk by chunk
    elif kind == "fp8":  # one row on the native kernel; the expansion is the chunked decode many rows take
        w0 = quant.quantize_fp8_block(dense)
        fn = lambda x, w: quant.fp8_block_linear(x, *w)  # noqa: E731
        expand = lambda w: quant.fp8_block_linear(one, *w, native=False)  # noqa: E731
    else:
        w0 = quant.pack_int4(dense)
        fn = lambda x, w: quant.int4_linear(x, *w, shape=(out, inp))  # noqa: E731
        expand = lambda w: quant.int4_linear(one, *w, shape=(out, inp), native=False)  # noqa: E731
    del dense
    parts = w0 if isinstance(w0, tuple) else (w0,)
    per = sum(t.numel() * t.element_size() for t in parts)
    count = max(2, -(-nbytes // per))
    copy = _resident_copy if resident else torch.Tensor.clone
    ws = [tuple(copy(t) for t in parts) if isinstance(w0, tuple) else copy(w0) for _ in range(count)]
    return ws, per * count, fn, expand


DEFAULT_SHAPE = (2048, 1024)  # an expert projection's (out, in) where the model's is not known
# A decode token streams every weight it multiplies from DRAM (q3m_med: 16 layers x 8 experts x 3 MiB + 84 MB of
# attention weights a token, its experts not the last token's), so a one-row probe cycles through distinct buffers
# of at least this many stored bytes: STREAM_LLC_MULTIPLE x the last-level cache sysfs states, and at least
# STREAM_MIN_BYTES (where no cache size is stated). Measured here (32 MiB L3, alternating in one process): the fused
# GLU call at 57-62 GB/s over 24 MiB of experts, 35-48 GB/s over 48 MiB (the old probe), 28-38 GB/s over 120-384
# MiB, and the engine's decode through the same call at 28-31 GB/s (docs/performance.md, "kernel probes past the
# last-level cache").
STREAM_LLC_MULTIPLE = 4
STREAM_MIN_BYTES = 128 << 20
CACHE_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")


def _cache_size(text: str) -> int:
    """sysfs's cache size ("32768K", "1M", "512") in bytes."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def llc_bytes(root: Path | None = None) -> int:
    """This CPU's last-level cache: the size of the highest-level data or unified cache sysfs lists (under `root`,
    default CACHE_SYSFS); 0 when it lists none (not Linux, a restricted container)."""
    best = (0, 0)
    try:
        entries = sorted((root or CACHE_SYSFS).glob("index*"))
    except OSError:
        return 0
    for d in entries:
        try:
            if (d / "type").read_text().strip() not in ("Data", "Unified"):
                continue
            best = max(best, (int((d / "level").read_text()), _cache_size((d / "size").read_text())))
        except (OSError, ValueError):
            continue
    return best[1]


def stream_bytes() -> int:
    """Stored weight bytes a kernel probe streams per pass: past the last-level cache, as a decode token's are."""
    return max(STREAM_MIN_BYTES, STREAM_LLC_MULTIPLE * llc_bytes())


def weight_rates(kind: str, seconds: float = 0.6, shape: tuple[int, int] = DEFAULT_SHAPE,
                 wide: bool = True, nbytes: int | None = None) -> tuple[float, float]:
    """(one-row bytes/s through the engine's linear for the format, stored bytes/s expanded to fp32 for a multi-row
    GEMM) over matrices of `shape` (the model's own expert projection: a small matrix pays its call's fixed cost
    on fewer bytes) in distinct buffers of `nbytes` stored bytes in all (default stream_bytes(): from DRAM, as a
    decode token streams them; the overhead probe passes its small checkpoint's own weight bytes)."""
    out, inp = shape
    ws, nbytes, fn, expand = _weights(kind, out, inp, stream_bytes() if nbytes is None else nbytes)
    x = torch.randn(1, inp)
    few = len(ws) if kind in ("bf16", "f32") else 1  # torch's decode of a packed format is slow: one matrix a burst

    def one() -> None:
        for w in ws:
            fn(x, w)

    def expand_all() -> None:
        for w in ws[:few]:
            expand(w)

    if not wide:  # the one-row rate alone, over all of `seconds`
        return _rate(one, nbytes, seconds), 0.0
    return _rate(one, nbytes, seconds / 2), _rate(expand_all, nbytes * few / len(ws), seconds / 2)


def _glu_experts(shape: tuple[int, int], count: int, codec: str = "") -> tuple[list, list[tuple[int, int, int]]]:
    """`count` bf16 GLU experts of shape = (inter, hidden) (gate, up [inter, hidden], down [hidden, inter]) in
    distinct buffers: (their tensors, which the caller keeps alive; their addresses as fused.moe_glu_bf16 takes
    them). One expert is made and copied. codec "b12": each matrix b12-coded in its smaller form (kernels/b12.py,
    as `moestream pack --codec b12` stores a pack's experts), passed by its tagged address as the engine passes a
    coded expert."""
    inter, hidden = shape
    gen = torch.Generator().manual_seed(0)
    first = [(torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)
             for dims in ((inter, hidden), (inter, hidden), (hidden, inter))]
    if codec == "b12":
        from moestream.kernels import b12

        shapes = [tuple(m.shape) for m in first]
        coded = [b12.encode_smaller(m) for m in first]  # as pack codes them
        experts = [coded] + [[c.clone() for c in coded] for _ in range(count - 1)]
        return experts, [tuple(b12.B12Weight.wrap(c, sh).tagged_address for c, sh in zip(e, shapes))
                         for e in experts]
    if codec:
        raise ValueError(f"no GLU probe for expert codec {codec!r}")
    experts = [first] + [[m.clone() for m in first] for _ in range(count - 1)]
    return experts, [tuple(m.data_ptr() for m in e) for e in experts]


def _glu_expert_bytes(experts: list) -> int:
    """Stored bytes of one probe expert (its three matrices: bf16, or their coded bytes)."""
    return sum(m.numel() * m.element_size() for m in experts[0])


def glu_rate(shape: tuple[int, int], top_k: int, seconds: float = 0.3, nbytes: int | None = None,
             codec: str = "") -> float:
    """Bytes/s of one activation row through groups of `top_k` bf16 GLU experts (gate and up [inter, hidden], down
    [hidden, inter] for shape = (inter, hidden)), one fused native call per group as the engine's decode layer makes
    it, cycling through distinct experts of `nbytes` in all (default stream_bytes(): past the last-level cache, as a
    decode token's experts stream from DRAM; at least two groups). codec "b12": b12-coded experts, the rate in
    their stored (coded) bytes."""
    from moestream.kernels import cpu, fused

    if not cpu.available():
        raise RuntimeError("no native kernels")
    inter, hidden = shape
    k = max(1, top_k)
    bf16_bytes = 3 * inter * hidden * 2  # sizes the working set (coded experts are smaller: still past the LLC)
    groups = max(2, -(-(stream_bytes() if nbytes is None else nbytes) // (bf16_bytes * k)))
    experts, parts = _glu_experts(shape, groups * k, codec)
    per = _glu_expert_bytes(experts)  # the rate is in stored bytes
    x, out = torch.randn(1, hidden), torch.zeros(1, hidden)

    def work() -> None:
        for g in range(groups):
            fused.moe_glu_bf16(x, list(range(k)), parts[g * k:(g + 1) * k], inter, out)

    return _rate(work, per * k * groups, seconds)


GLU_ROWS = (2, 4, 16, 64, 256)  # rows per expert the many-row probe times (a batch's experts take N x top_k / E
# each; a prefill step of 2,300 rows gives q3m_med's experts about 290)


def glu_rows_times(shape: tuple[int, int], seconds: float = 0.4, rows: tuple[int, ...] = GLU_ROWS,
                   nbytes: int | None = None, compute: str = "fp32", codec: str = "") -> dict:
    """Seconds per expert of the fused bf16 GLU call (fused.moe_glu_bf16, the path a batch step takes for bf16 GLU
    experts: below its panel threshold row by row, above it the panel kernel) at each of `rows` rows per expert:
    {"group": {rows: s}} for distinct experts of `nbytes` in all (default stream_bytes(), past the last-level cache)
    in one call (a layer step's resident experts), and {"single": {rows: s}} for one expert a call (each read
    expert as it lands). Every row goes through every expert (no routing table: the same kernel work per (row,
    expert) pair). `compute` "bf16": the call as --compute-dtype bf16 makes it (bf16-rounded activations, the
    vdpbf16ps kernels), which the engine takes for a step of BF16_GLU_MIN_ROWS rows or more. codec "b12":
    b12-coded experts (_glu_experts)."""
    from moestream.kernels import cpu, fused

    if not cpu.available():
        raise RuntimeError("no native kernels")
    inter, hidden = shape
    per = 3 * inter * hidden * 2
    count = max(2, -(-(stream_bytes() if nbytes is None else nbytes) // per))
    experts, parts = _glu_experts(shape, count, codec)
    out: dict[str, dict[str, float]] = {"group": {}, "single": {}}
    each = seconds / (2 * len(rows))
    for r in rows:
        x, y = torch.randn(r, hidden), torch.zeros(r, hidden)

        def group() -> None:
            fused.moe_glu_bf16(x, list(range(count)), parts, inter, y, compute=compute)

        def single() -> None:
            for p in parts:
                fused.moe_glu_bf16(x, [0], [p], inter, y, compute=compute)

        out["group"][str(r)] = 1.0 / _rate(group, count, each)
        out["single"][str(r)] = 1.0 / _rate(single, count, each)
    return out


DENSE_ROWS = (1, 16, 64, 256)  # rows of a step the dense probe times (one-token decode, batch steps, prompt chunks)
DENSE_SHAPES_MAX = 4  # dense shapes probed per model (the most bytes); the lm_head's apart
DENSE_MATRIX_MAX = 64 << 20  # a probed dense matrix's stored bytes at most: a larger one (K3's lm_head, 2.3 GB)
# is probed with its rows cut to fit (a GEMV / GEMM of that width runs at the same rate per byte)


DENSE_KINDS = {"bf16": 2, "fp8": 1}  # dense formats the dense probe times over many rows: bytes a weight


def dense_probe_shape(shape: tuple[int, int], kind: str = "bf16") -> tuple[int, int]:
    """The (out, in) a dense weight of `shape` in `kind` (DENSE_KINDS) is probed at: its own, its rows cut to
    DENSE_MATRIX_MAX."""
    out, inp = shape
    return max(1, min(out, DENSE_MATRIX_MAX // (DENSE_KINDS[kind] * max(1, inp)))), inp


def dense_rows_times(shape: tuple[int, int], seconds: float = 0.4, rows: tuple[int, ...] = DENSE_ROWS,
                     nbytes: int | None = None, kind: str = "bf16") -> dict:
    """Seconds per call of the engine's `blocks.linear` through one dense weight of `shape` (out, in), bf16 or
    block-FP8 (`kind`, as DeepSeek-V3's dense weights: kernels/qweight.BlockFp8Weight), over each of `rows`
    activation rows, cycling through distinct copies of the weight of `nbytes` stored bytes in all (default
    stream_bytes(): from DRAM, as a step streams them), one copy a call: {"fp32": {rows: s}} as the engine runs by
    default (bf16: the one-row native kernel up to cpu.MAX_TOKENS_BF16 rows, above it the weight upcast slab by slab
    and torch's fp32 GEMM; FP8: the native kernel below quant.FP8_NATIVE_MAX_T rows, above it the chunked decode and
    GEMM), and for bf16 {"bf16": {rows: s}} under compute_dtype("bf16") for the rows that path takes
    (blocks.BF16_MIN_ROWS and more; only with the native kernels)."""
    from moestream.kernels import cpu
    from moestream.kernels.qweight import BlockFp8Weight
    from moestream.kernels.quant import FP8_BLOCK
    from moestream.models.blocks import BF16_MIN_ROWS, compute_dtype, linear

    out_f, inp = shape
    ws, _, _, _ = _weights(kind, out_f, inp, stream_bytes() if nbytes is None else nbytes, resident=True)
    if kind == "fp8":
        ws = [BlockFp8Weight.wrap(codes, scale, FP8_BLOCK) for codes, scale in ws]
    got: dict[str, dict[str, float]] = {"fp32": {}, "bf16": {}}
    modes = ["fp32"] + (["bf16"] if cpu.available() and kind == "bf16" else [])
    each = seconds / (len(rows) * len(modes))
    for r in rows:
        x = torch.randn(r, inp)
        for mode in modes:
            if mode == "bf16" and r < BF16_MIN_ROWS:
                continue
            at = [0]

            def call() -> None:
                linear(x, ws[at[0] % len(ws)])
                at[0] += 1

            with compute_dtype(mode):
                got[mode][str(r)] = 1.0 / _rate(call, 1, each)
    return got


KV_CONTEXTS = (8, 520)  # context lengths the KV storage probe decodes at (the slope per token of context)
KV_BATCH = 8  # sequences of the probe's batch decode step (several sequences: the paged kernel's path)
KV_PROMPT = 64  # a prompt's tokens in the probe's prefill step


def kv_costs(path: Path, kv_dtype: str, seconds: float = 1.0) -> dict[str, float]:
    """Seconds per layer with a cache that the `kv_dtype` storage costs beyond fp32's (quantise on write,
    dequantise on read), measured on the checkpoint at `path` (the overhead probe's, at the model's widths): the
    same steps on two engines, fp32 and `kv_dtype` caches, alternated, medians; per sequence of a one-row decode
    step ("decode_s" + "decode_row_s" x context), of a KV_BATCH-sequence decode step ("batch_s" + "batch_row_s" x
    context) and per token of a fresh prompt ("prefill_token_s"), over the checkpoint's layers with a KV / latent
    cache. Each difference is floored at 0."""
    from moestream import Engine

    engines = {d: Engine.open(path, kv_dtype=d) for d in ("fp32", kv_dtype)}
    try:
        layers = max(1, len(_probe_facts(path).attention))  # the layers with a KV / latent cache
        each = seconds / 12
        got: dict[str, dict] = {d: {} for d in engines}
        for _ in range(2):  # alternated: a burst of load falls on both
            for d, eng in engines.items():
                for c in KV_CONTEXTS:
                    got[d].setdefault(("one", c), []).append(_context_step(eng, 1, c, each))
                    got[d].setdefault(("batch", c), []).append(_context_step(eng, KV_BATCH, c, each))
                got[d].setdefault("prefill", []).append(_prompt_step(eng, KV_PROMPT, each))
    finally:
        for eng in engines.values():
            eng.close()
    med = {d: {k: statistics.median(v) for k, v in g.items()} for d, g in got.items()}
    diff = {k: med[kv_dtype][k] - med["fp32"][k] for k in med["fp32"]}
    lo, hi = KV_CONTEXTS
    out = {}
    for kind, rows in (("one", 1), ("batch", KV_BATCH)):
        slope = (diff[(kind, hi)] - diff[(kind, lo)]) / (hi - lo) / rows / layers
        base = diff[(kind, lo)] / rows / layers - slope * lo
        name = "decode" if kind == "one" else "batch"
        out[f"{name}_row_s"], out[f"{name}_s"] = max(0.0, slope), max(0.0, base)
    out["prefill_token_s"] = max(0.0, diff["prefill"] / KV_PROMPT / layers)
    return out


def kv_probe(model_type: str, kv_dtype: str, seconds: float = 1.0, top_k: int = 0, experts: int = 0,
             widths: dict[str, int] | None = None) -> tuple[dict[str, float], str]:
    """kv_costs on the overhead probe's small checkpoint of the family at the model's widths: (costs, what)."""
    from moestream.synth import supported

    family = model_type if model_type in supported() else "qwen3_moe"
    with tempfile.TemporaryDirectory(prefix="moestream-plan-kv-") as tmp:
        what = _tiny(family, Path(tmp) / "m", top_k, experts, widths or {})
        return kv_costs(Path(tmp) / "m", kv_dtype, seconds), what


def _prompt_step(eng, tokens: int, seconds: float) -> float:
    """Median seconds of a fresh sequence's first step over a `tokens`-token prompt."""
    times, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        s = eng.new_sequence()
        try:
            t = time.perf_counter()
            eng.step([(s, [1 + i % 7 for i in range(tokens)])])
            times.append(time.perf_counter() - t)
        finally:
            eng.free(s)
    return statistics.median(times)


def _context_step(eng, rows: int, context: int, seconds: float) -> float:
    """Median seconds of one decode step (one token each) of `rows` sequences holding `context` tokens."""
    states = [eng.new_sequence() for _ in range(rows)]
    try:
        for i, s in enumerate(states):
            eng.prefill(s, [1 + (i + j) % 7 for j in range(context)])
        times, deadline, n = [], time.perf_counter() + seconds, 0
        while (time.perf_counter() < deadline or len(times) < 3) and n < 16:
            t = time.perf_counter()
            for _ in eng.step([(s, [3 + n % 5]) for s in states]):  # its logits read, as a scheduler does
                pass
            times.append(time.perf_counter() - t)
            n += 1
    finally:
        for s in states:
            eng.free(s)
    return statistics.median(times)


def glu_available() -> bool:
    from moestream.kernels import cpu

    return cpu.available()


def glu_key(shape: tuple[int, int], top_k: int, codec: str = "") -> str:
    """The cache's key for the fused GLU kernel's one-row rate: bf16 experts, or coded ones (`codec`)."""
    return f"glu {codec or 'bf16'} {shape[0]}x{shape[1]} top-{top_k}"


def shape_key(kind: str, shape: tuple[int, int]) -> str:
    """The cache's key for a format's rates at one matrix shape."""
    return f"{kind} {shape[0]}x{shape[1]}"


def gemm_rate(seconds: float = 0.5) -> float:
    """fp32 torch.mm FLOP/s at an expert's shape over 64 rows."""
    a, b = torch.randn(64, 1024), torch.randn(1024, 2048)
    return _rate(lambda: torch.mm(a, b), 2 * 64 * 1024 * 2048, seconds)


def memory_rate(seconds: float = 0.3) -> float:
    """fp32 bytes/s read by a sum over stream_bytes() (past the last-level cache)."""
    data = torch.ones(stream_bytes() // 4, dtype=torch.float32)
    return _rate(lambda: torch.sum(data), data.numel() * 4, seconds)


def _fresh_mapping(nbytes: int) -> tuple[mmap.mmap, float]:
    """A fresh private anonymous mapping of `nbytes` with every page written once (the kernel zeroes each), and
    the seconds that took: one byte a page, in C, so that the faults, not Python, are timed."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = torch.frombuffer(m, dtype=torch.uint8)
    t = time.perf_counter()
    view[::mmap.PAGESIZE].fill_(1)
    took = time.perf_counter() - t
    del view  # the view pins the mapping: closing it needs the view gone
    return m, took


def page_fault_rate(seconds: float = 0.2, nbytes: int = 32 << 20) -> float:
    """Bytes/s of fresh private anonymous pages mapped and faulted in, one write per page (the kernel zeroes each):
    what a missed expert's read buffer costs the CPU before the disk fills it (the reader hands its buffers back
    to the kernel after each one-token step)."""
    return _rate(lambda: _fresh_mapping(nbytes)[0].close(), nbytes, seconds)


def deep_fault_rates(limit: int | None = None, seconds: float = DEEP_PROBE_S, chunk: int = 64 << 20,
                     after: int = DEEP_AFTER) -> tuple[float, float, str]:
    """(hot_bytes, deep rate, what was seen: deep_summary) of fresh memory held as it is taken, `chunk` at a time,
    each page written once until a chunk runs under half the first chunks' rate, then `after` chunks more;
    none slowed within `limit` bytes (default: half of the memory available, at most DEEP_PROBE_BYTES) or
    `seconds`: (0, 0). A cold cache fills with memory the process takes for the first time: on a VM whose host
    took the guest's free pages back (virtio-balloon free page reporting) the first write to such a page stalls
    for the host's fault, ~7x the price of a recently freed one here (docs/plan.md, "Deep memory")."""
    if limit is None:
        limit = min(DEEP_PROBE_BYTES, (memory_available() or 0) // 2)
    held, rates, deadline = [], [], time.perf_counter() + seconds
    try:
        while len(held) * chunk + chunk <= limit and time.perf_counter() < deadline:
            m, took = _fresh_mapping(chunk)
            held.append(m)
            rates.append(chunk / took)
            drop = deep_split(rates)
            if drop is not None and len(rates) - drop >= after:
                break
    finally:
        for m in held:
            m.close()
    return deep_summary(rates, chunk)


def deep_split(rates: list[float], first: int = 4) -> int | None:
    """Index of the first chunk after the first `first` that ran under half their median rate (None: none)."""
    if len(rates) <= first:
        return None
    head = statistics.median(rates[:first])
    return next((i for i in range(first, len(rates)) if rates[i] < head / 2), None)


def deep_summary(rates: list[float], chunk: int) -> tuple[float, float, str]:
    """deep_fault_rates' answer from its chunks' rates: (all the bytes it took, the median rate from the first slow
    chunk on, a line). All it took, the slow part included, is the next process's hot memory once freed (three
    probes in a row here found 2.88, 3.38 and 3.75 GiB hot, each 0.5 GiB beyond the last)."""
    drop = deep_split(rates)
    taken = len(rates) * chunk
    if drop is None:
        rate = statistics.median(rates) if rates else 0.0
        return 0.0, 0.0, f"no slowdown over {taken / 2**30:.3g} GiB held ({rate / 1e9:.3g} GB/s)"
    deep = statistics.median(rates[drop:])
    return float(taken), deep, (f"{drop * chunk / 2**30:.3g} GiB at {statistics.median(rates[:drop]) / 1e9:.3g} GB/s,"
                                f" then {deep / 1e9:.3g} GB/s over {(len(rates) - drop) * chunk >> 20} MiB")


def disk_rate(files: list[Path], seconds: float) -> float:
    """bench's direct-I/O probe (random 4 MiB reads, a deep queue) over the model's shards, each of its threads
    reading into DISK_PROBE_BUFFERS buffers in turn: an expert cache's reads land all over memory, and on a VM a
    read's rate follows the memory it lands in (docs/plan.md, "Deep memory")."""
    from moestream.bench import PROBE_THREADS, probe_disk

    # shorter, a loaded machine may finish no read; a fresh seed a probe, as the engine's reads do not repeat
    return probe_disk(files, PROBE_THREADS, max(0.5, seconds), seed=random.randrange(1 << 30),
                      buffers=DISK_PROBE_BUFFERS)


def stream_rate(files: list[Path], seconds: float) -> float:
    """bench's stream probe (64 MiB slabs back to back into two kept huge-page buffers, as streamed dense weights
    are read) over the model's largest shard; 0.0 where it cannot run (no shard of two slabs, O_DIRECT refused)."""
    from moestream.bench import probe_stream

    return probe_stream(files, max(0.5, seconds), seed=random.randrange(1 << 30))


def disk_rate_at(directory: Path, seconds: float, nbytes: int = PROBE_FILE_BYTES) -> float:
    """The probe over a scratch file written in `directory` (a model with no local shards: where they would go)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="plan-probe-", suffix=".bin", dir=directory)
    try:
        block = os.urandom(1 << 20)
        with os.fdopen(fd, "wb") as fh:
            for _ in range(max(8, nbytes >> 20)):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        return disk_rate([Path(name)], seconds)
    finally:
        os.unlink(name)


def overhead_key(model_type: str, top_k: int, widths: dict[str, int] | None = None) -> str:
    """The overhead cache's key: the family, its routed experts per token (each is a call with a fixed cost) and
    the widths the probe model took (ops that scale with them but carry no weights: norms, rope, KV appends)."""
    key = f"{model_type} top-{top_k}" if top_k else model_type
    return key + "".join(f" {k}{v}" for k, v in sorted((widths or {}).items()))


WIDTHS = {"hidden": "hidden_size", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
          "head_dim": "head_dim"}  # Preset field: config.json key; the overhead probe's model takes these widths


MLA_HEAD_DIM = "qk_nope_head_dim"  # an MLA family's per-head width: the synthesizers take it as the Preset's head_dim
PROBE_MAX_BYTES = 512 << 20  # the overhead probe's checkpoint at the model's widths may take this much at most


def model_widths(raw: dict) -> dict[str, int]:
    """The planned model's widths that the overhead probe's checkpoint copies (those its config states). An MLA
    family's head width is its `qk_nope_head_dim` (the MLA and KDA head width of every synthesizer: Kimi K3's
    config has no `head_dim`, Kimi Linear's `head_dim` is the rope width)."""
    raw = raw.get("text_config", raw)
    out = {k: int(raw[v]) for k, v in WIDTHS.items() if isinstance(raw.get(v), int) and raw[v] > 0}
    if isinstance(raw.get(MLA_HEAD_DIM), int) and raw[MLA_HEAD_DIM] > 0:
        out["head_dim"] = int(raw[MLA_HEAD_DIM])
    return out


def probe_bytes(family: str, shape) -> int:
    """Bytes the synthesizer of `family` would write for `shape`, from its tensor inventory alone."""
    from moestream.synth.families import SpecialIds, synth_family
    from moestream.synth.writer import nbytes

    fam = synth_family(family)
    return sum(nbytes(s) for s in fam.tensors(fam.config(shape, SpecialIds(bos=0, eos=1))))


# Families whose narrow probe needs a wider hidden size and experts to take the planned model's kernels: the
# DeepSeek-V3 synth writes block-FP8 weights whose widths and column tiles are multiples of 64 (the native FP8
# kernel's, kernels/quant.fp8_native) from hidden 512 (64-wide tiles, latent ranks 128 / 64) and experts 64 wide;
# at the tiny hidden size every FP8 product took the chunked torch path, about 20 ms a layer step of "overhead"
# that a DeepSeek-V3 at its published widths never pays (docs/plan.md).
PROBE_WIDTHS = {"deepseek_v3": {"hidden": 512, "moe_intermediate": 64}}


def _tiny(family: str, out: Path, top_k: int, experts: int, widths: dict[str, int]) -> str:
    """Write a small checkpoint of `family` at the planned model's `widths` (hidden size, heads), routing `top_k`
    of `experts` (at most 64) experts per token, with 32-wide experts and a 512-token vocabulary (weights of a few
    MB); where that checkpoint would exceed PROBE_MAX_BYTES (a full-width MLA / KDA model: about 0.5 GB a layer)
    or the synthesizer cannot take those widths, the heads' widths at the tiny hidden size (PROBE_WIDTHS' hidden
    size and expert width for the families named there), else the plain tiny preset. Returns what was written."""
    from dataclasses import replace

    from moestream.synth import synthesize
    from moestream.synth.families import preset, synth_family
    from moestream.synth.writer import write_checkpoint

    own = PROBE_WIDTHS.get(family, {})
    # the heads' widths at the tiny hidden size (or the family's own)
    narrow = {k: v for k, v in widths.items() if k != "hidden"} | {k: v for k, v in own.items() if k == "hidden"}
    for w in ([widths, narrow, {}] if widths else [{}]):
        if not top_k and not w:
            break
        shape = replace(preset("tiny"), name="plan-overhead", top_k=top_k or preset("tiny").top_k,
                        experts=max(top_k, min(experts or 16, 64)), **w,
                        **({"moe_intermediate": own.get("moe_intermediate", 32)} if w else {}))
        try:
            if w and (size := probe_bytes(family, shape)) > PROBE_MAX_BYTES:  # full-width MLA / KDA layers
                raise ValueError(f"{size} bytes at the model's widths")
            write_checkpoint(synth_family(family), shape, out, 0, default_cache_dir(), False)
            dims = ", ".join(f"{k} {v}" for k, v in w.items())
            return f"synthetic {family} routing top-{shape.top_k} of {shape.experts} experts" + (
                f" at {dims}" if dims else " at tiny widths")
        except Exception:  # noqa: BLE001 - a family with constraints (groups, dims): fewer of the model's traits
            shutil.rmtree(out, ignore_errors=True)
    synthesize(family, out, "tiny", progress=False)
    return f"tiny synthetic {family} (its own top-k)"


def _probe_facts(path: Path):
    from moestream.planner.facts import model_facts, open_plan

    p = open_plan(path)
    try:
        return model_facts(path, p)
    finally:
        p.store.close()


def _weights_time(f, gemv: dict[str, float]) -> float:
    """Seconds a one-row step of the probe checkpoint (its ModelFacts `f`) spends streaming its weights at `gemv`
    (bytes/s per format): what its measured step time holds beyond the engine's fixed cost."""
    rate = lambda k: gemv.get(k) or gemv["bf16"]  # noqa: E731
    expert = gemv.get("glu") if f.expert_kind == "bf16" and gemv.get("glu") else rate(f.expert_kind)
    return (sum(b / rate(k) for k, b in f.dense_bytes.items()) + f.head_bytes / rate(f.head_kind)
            + f.moe_layers * f.top_k * f.expert_bytes / expert)


def _step_bytes(f) -> int:
    """Weight bytes a one-row step of the probe checkpoint (its ModelFacts `f`) multiplies: its working set, which
    stays in the last-level cache between its timed steps (a few MB at 32-wide experts), unlike a real model's."""
    return int(sum(f.dense_bytes.values()) + f.head_bytes + f.moe_layers * f.top_k * f.expert_bytes)


# the overhead probe's wider multi-row step (with its 8-row one: the fixed cost and cost per row). A batch runs
# hundreds of rows; between 8 and 32 rows the probe's step grew 1.6-2.8x faster per row than between 8 and 128
# (docs/plan.md, "The multi-row overhead at a batch's width"), so a line through 32 over-counted wide steps.
BATCH_ROWS = 128


def nearest_dense(tables: dict, shape: tuple[int, int], kind: str = "bf16") -> tuple[str, float] | None:
    """(the probed dense shape's key of format `kind` nearest `shape` in size, the parameters' ratio shape /
    probed), or None."""
    size = {}
    for k in tables:  # "FORMAT OUTxIN" keys (a seeded file's format-only key names no shape)
        dims = k.split()[-1].split("x")
        if k.split()[0] == kind and len(dims) == 2 and all(d.isdigit() for d in dims):
            size[k] = max(1, int(dims[0]) * int(dims[1]))
    if not size:
        return None
    params = max(1, shape[0] * shape[1])
    best = min(size, key=lambda k: (abs(math.log(size[k] / params)), k))
    return best, params / size[best]


def interp_rows(table: dict[str, float], x: float) -> float:
    """`table` {rows: seconds} at `x` rows: linear between the probed counts, on the last segment's line beyond
    them, the first count's value below it; never less at more rows than at fewer (a probe slowed by load)."""
    pts = sorted((float(k), v) for k, v in table.items())
    for i in range(1, len(pts)):
        pts[i] = (pts[i][0], max(pts[i][1], pts[i - 1][1]))
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1 or (x1, y1) == pts[-1]:
            return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return pts[-1][1]


def dense_rows_s(shapes: dict[tuple[str, int, int], int], tables: dict, rows: float, compute: str = "fp32") -> float:
    """Seconds of the bf16 and block-FP8 dense weights `shapes` ((format, out, in) -> count) over `rows` rows by the
    dense probe's `tables` (shape key -> {precision: {rows: s}}): each at the probed shape of its format nearest in
    size, scaled by its parameters; 0 without tables."""
    t = 0.0
    for (kind, o, i), n in shapes.items():
        got = nearest_dense(tables, (o, i), kind) if kind in DENSE_KINDS else None
        if got is None:
            continue
        by = tables[got[0]]
        mode = compute if by.get(compute) and min(float(r) for r in by[compute]) <= rows else "fp32"
        t += n * interp_rows(by[mode], rows) * got[1]
    return t


def overhead(model_type: str, seconds: float = 1.0, top_k: int = 0, experts: int = 0,
             widths: dict[str, int] | None = None, gemv: dict[str, float] | None = None,
             rounds_n: int = 1, rate_probe: Callable[[int], dict[str, float]] | None = None,
             dense_tables: dict | None = None) -> Overhead:
    """The engine's per-layer-step fixed cost for `model_type` routing `top_k` of `experts` experts per token at
    the model's `widths`: a small synthetic checkpoint decoded warm one row and eight rows at a time, and prefilled
    in 64-token chunks, `rounds_n` times; time per layer, less its weights' time (priced apart by the planner)
    at the kernel rates `rate_probe(working set)` measures in the same round, right before the steps, over as many
    bytes as the checkpoint's step multiplies (they stay in the last-level cache between its steps, so they are
    priced at the in-cache rate; else at `gemv`), so that a burst of load slows both sides of the difference; the
    median of the rounds' differences is kept."""
    from moestream import Engine
    from moestream.synth import supported

    family = model_type if model_type in supported() else "qwen3_moe"
    with tempfile.TemporaryDirectory(prefix="moestream-plan-") as tmp:
        what = _tiny(family, Path(tmp) / "m", top_k, experts, widths or {})
        facts = _probe_facts(Path(tmp) / "m")
        eng = Engine.open(Path(tmp) / "m")
        beng = Engine.open(Path(tmp) / "m", compute_dtype="bf16")  # the multi-row steps in bf16 compute too
        try:
            layers = len(eng.model.layers)
            runs, general = [], []
            for _ in range(max(1, rounds_n)):
                rates = rate_probe(_step_bytes(facts)) if rate_probe is not None else gemv
                w = _weights_time(facts, rates) if rates else 0.0
                runs.append((_step_time(eng, 1, 1, seconds / 3), _step_time(eng, 8, 1, seconds / 3),
                             _step_time(eng, 1, 64, seconds / 3), w, _step_time(eng, BATCH_ROWS, 1, seconds / 3),
                             _step_time(beng, 8, 1, seconds / 3), _step_time(beng, BATCH_ROWS, 1, seconds / 3)))
                general.append(_general_step(eng, seconds / 3))
            tight = _tight_budget(eng)
        finally:
            eng.close()
            beng.close()
        one, eight, chunk, weights_s, wide, eight_b, wide_b = (statistics.median(col) for col in zip(*runs))
        off_warm = statistics.median(g for g, _ in general)
        misses = [_miss_time(Path(tmp) / "m", tight, off_warm, seconds / 3) for _ in range(max(1, rounds_n))]
    note = "" if family == model_type else f" (no synthetic {model_type}: measured on {family})"
    diff = [r[0] - r[3] for r in runs]
    spread = f"median of {len(runs)} rounds (decode {min(r[0] for r in runs) * 1e3:.3g}-" \
             f"{max(r[0] for r in runs) * 1e3:.3g} ms a step, less its weights at the same round's kernel rates " \
             f"({min(r[3] for r in runs) * 1e3:.3g}-{max(r[3] for r in runs) * 1e3:.3g} ms): " \
             f"{min(diff) * 1e3:.3g}-{max(diff) * 1e3:.3g} ms; " \
             f"off the warm path {min(g for g, _ in general) * 1e3:.3g}-{max(g for g, _ in general) * 1e3:.3g} ms " \
             f"a step; a miss {min(misses) * 1e3:.3g}-{max(misses) * 1e3:.3g} ms beyond that)"
    # a multi-row step's fixed cost and cost per row in each compute dtype, from steps of 8 and BATCH_ROWS rows
    # (both the multi-row path; fresh sequences' first step after an 8-token prompt, which measured the same as
    # steadily decoding ones: docs/performance.md), less the probe's dense weights at those rows by the model's
    # dense probe in that dtype (`dense_tables`: the probe model has the planned model's attention widths, so its
    # projections are the model's shapes). What the step does beyond the dense probe's calls stays in the line:
    # in fp32, a step's upcast copies of its weights and its GLU scratch in fresh memory (docs/plan.md)
    lines = {}
    for mode, small, big in (("fp32", eight, wide), ("bf16", eight_b, wide_b)):
        d8, dw = (dense_rows_s(facts.dense_shapes, dense_tables or {}, r, mode) for r in (8, BATCH_ROWS))
        row_s = max(0.0, ((big - dw) - (small - d8)) / (BATCH_ROWS - 8) / layers)
        lines[mode] = (max(0.0, (small - d8) / layers - 8 * row_s), row_s)
        spread += (f"; multi-row steps of 8 / {BATCH_ROWS} rows in {mode} compute {small * 1e3:.3g} / "
                   f"{big * 1e3:.3g} ms, less their dense weights {d8 * 1e3:.3g} / {dw * 1e3:.3g} ms")
    return Overhead(max(0.0, statistics.median(diff)) / layers, max(0.0, (eight - one) / 7 / layers),
                    max(0.0, statistics.median(r[2] - r[3] for r in runs)) / layers,
                    f"{what}, {layers} layers{note}, {spread}", statistics.median(misses),
                    max(0.0, off_warm - one) / layers, statistics.median(la for _, la in general),
                    *lines["fp32"], *lines["bf16"])


def _tight_budget(eng) -> tuple[int, int]:
    """(budget, state room): a budget keeping every dense weight of the open probe engine resident but only
    top_k + 1 experts cached, plus room for the miss probe's sequence's state (its 8-token prompt and at most
    MISS_STEPS_MAX steps; full-width KDA layers hold megabytes of recurrent state whatever the length, and room the
    state leaves unused would cache experts): most routed experts then miss."""
    from moestream.planner.state import state_shape

    k = max(1, eng.plan.layout.top_k)
    room = state_shape(eng.plan.config).at(8, 8 + MISS_STEPS_MAX, 256) + (256 << 10)
    return eng.memory.fixed() + (k + 1) * eng.plan.max_expert_bytes + room, room


MISS_STEPS_MAX = 48  # the miss probe's decode steps stop here (its state room is sized for them)


def _miss_time(path: Path, budget: tuple[int, int], general_step: float, seconds: float) -> float:
    """Seconds of engine work per missed expert beyond a hit: one-token decode steps under `budget` (most experts
    miss), their wall time less the I/O wait, less the step off the warm path (`general_step`: every layer of them
    takes it), over the misses. The probe's experts are tiny, so this is the per-miss work (landing, the one-expert
    path, eviction), not its bytes."""
    from moestream import Engine

    eng = Engine.open(path, ram_budget=budget[0], state_room=budget[1])
    try:
        times, stats = eng.runner.times, eng.runner.cache.stats
        state = eng.new_sequence()
        tok = int(eng.prefill(state, [1 + i % 7 for i in range(8)]).argmax())
        wall = wait = 0.0
        misses, steps, deadline = 0, 0, time.perf_counter() + seconds
        while (time.perf_counter() < deadline or steps < 3) and steps < MISS_STEPS_MAX:
            w0, m0, t = times.io_wait_s, stats.misses, time.perf_counter()
            (logits,) = eng.step([(state, [tok])])
            wall += time.perf_counter() - t
            wait += times.io_wait_s - w0
            misses += stats.misses - m0
            steps += 1
            tok = int(logits.argmax()) if steps % 2 else (tok * 31 + 7) % eng.vocab_size  # vary the routing
        eng.free(state)
    finally:
        eng.close()
    return max(0.0, wall - wait - steps * general_step) / max(1, misses)


def _general_step(eng, seconds: float) -> tuple[float, float]:
    """(median seconds of a one-token step, lookahead seconds per layer step) with every expert cached but the
    warm path off, as in a layer step of a cold run that has a miss or a read in flight: ExpertRunner.run's general
    path (the lookahead router, the hits' grouped call apart from the native decode layer, the bookkeeping)."""
    runner = eng.runner
    t0, s0 = runner.times.lookahead_s, runner.times.steps
    runner.warm = lambda: False  # type: ignore[method-assign]  # what a read in flight does to the step
    try:
        step = _step_time(eng, 1, 1, seconds)
    finally:
        del runner.warm
    return step, (runner.times.lookahead_s - t0) / max(1, runner.times.steps - s0)


def _step_time(eng, rows: int, tokens: int, seconds: float) -> float:
    """Median seconds of one engine step over `rows` sequences of `tokens` tokens each (fresh states per step)."""
    times, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        states = [eng.new_sequence() for _ in range(rows)]
        try:
            eng.step([(s, [1 + i % 7] * 8) for i, s in enumerate(states)])  # some context to attend over
            t = time.perf_counter()
            for _ in eng.step([(s, list(range(3, 3 + tokens))) for s in states]):  # logits read, as a scheduler does
                pass
            times.append(time.perf_counter() - t)
        finally:
            for s in states:
                eng.free(s)
    return statistics.median(times)


# ---- the calibration ---------------------------------------------------------------------------------------------
@dataclass
class Calibrator:
    """Measures what is missing (or everything with `fresh`) and keeps the results in the cache file."""

    fresh: bool = False
    seconds: float = 1.0  # per probe (disk, each weight format, overhead); tests pass less
    rounds: int = ROUNDS  # probes per rate (median kept); tests pass 1
    log: Callable[[str], None] = lambda msg: None

    def __post_init__(self) -> None:
        self.data = _load()
        self.key = machine_key()
        self.measured: list[str] = []
        self.disk_done: set[str] = set()  # disks probed in this run (`fresh` probes each once)
        if self.fresh:
            self.data.get("machines", {}).pop(self.key, None)

    def _entry(self) -> dict:
        return self.data.setdefault("machines", {}).setdefault(self.key, {})

    def rates(self, kinds: set[str], model_type: str, top_k: int = 0, experts: int = 0,
              shapes: dict[str, tuple[int, int]] | None = None, widths: dict[str, int] | None = None,
              glu_shape: tuple[int, int] | None = None, dense_shapes: list[tuple[str, int, int]] | None = None,
              kv_dtype: str = "fp32", glu_codec: str = "", compute: str = "fp32") -> Rates:
        """The rates for weights of `kinds` (each probed at `shapes[kind]`, the model's matrix shape for it, else
        DEFAULT_SHAPE), the fp32 GEMM, memory, and the family's overhead at `top_k`; with `glu_shape` (a bf16 GLU
        expert's (inter, hidden)) the fused expert kernel over top_k of them, over many rows in fp32 and bf16
        compute; `dense_shapes`: bf16 and block-FP8 dense weights' (format, out, in) to time over DENSE_ROWS rows
        (dense_rows_times: bf16 in both precisions); `kv_dtype` other than fp32: its cache storage's cost
        (kv_probe); measured where missing. `glu_codec` "b12": the routed experts are b12-coded (a `pack --codec b12` checkpoint), so the fused
        expert kernel is probed over coded experts (rates in their coded bytes). `compute` "bf16": MXFP4 weights'
        one-row rate is their bf16 call's (MXFP4_BF16), as --compute-dtype bf16 runs them at every row count."""
        e = self._entry()
        src = e.setdefault("source", {})
        gemv, expand = e.setdefault("gemv", {}), e.setdefault("expand", {})
        chosen: dict[str, str] = {}
        for kind in sorted(kinds | {"bf16", "f32"}):
            shape = (shapes or {}).get(kind, DEFAULT_SHAPE)
            probe = MXFP4_BF16 if kind == "mxfp4" and compute == "bf16" else kind
            key = chosen[kind] = shape_key(probe, shape)
            if key not in gemv and probe in gemv:  # a rate stated for the format at any shape (seeded files)
                key = chosen[kind] = probe
            if key not in gemv:
                self.log(f"calibrating: {key} weight kernels")
                (gemv[key], expand[key]), spread = rounds(lambda: weight_rates(probe, self.seconds, shape),
                                                          self.rounds)
                src[f"gemv {key}"] = f"{spread}, {self._stamp()}"
        fmt = glu_codec or "bf16"  # the experts' stored format: bf16, or a coding of it
        gkey = glu_key(glu_shape, top_k, glu_codec) if glu_shape and top_k and glu_available() else None
        if gkey and gkey not in e.setdefault("glu_kernels", {}) and fmt in e["glu_kernels"]:
            gkey = fmt  # a rate stated for any shape (seeded files)
        if gkey and gkey not in e["glu_kernels"]:
            self.log(f"calibrating: {gkey} fused expert kernel")
            (e["glu_kernels"][gkey],), spread = rounds(
                lambda: glu_rate(glu_shape, top_k, self.seconds / 2, codec=glu_codec), self.rounds)
            src[gkey] = f"{spread}, {self._stamp()}"
        rkey = f"glu rows {fmt} {glu_shape[0]}x{glu_shape[1]}" if gkey and glu_shape else None
        if rkey and rkey not in e.setdefault("glu_rows", {}) and fmt in e["glu_rows"]:
            rkey = fmt  # stated for any shape (seeded files)
        if rkey and rkey not in e["glu_rows"]:
            self.log(f"calibrating: {rkey} fused expert kernel over many rows")
            got = []
            for _ in range(max(1, self.rounds)):  # fp32 and bf16 compute in each round (a burst of load: both)
                g = glu_rows_times(glu_shape, self.seconds / 2, codec=glu_codec)
                b = glu_rows_times(glu_shape, self.seconds / 2, compute="bf16", codec=glu_codec)
                got.append({**g, **{f"{k}_bf16": v for k, v in b.items()}})
            e["glu_rows"][rkey] = {k: {r: statistics.median(g[k][r] for g in got) for r in got[0][k]}
                                   for k in got[0]}
            mid = str(GLU_ROWS[-1])
            src[rkey] = (f"median of {len(got)} rounds (group, {mid} rows: "
                         f"{min(g['group'][mid] for g in got) * 1e3:.3g}-{max(g['group'][mid] for g in got) * 1e3:.3g}"
                         f" ms an expert), {self._stamp()}")
        dense_keys = {}  # shape key -> the cache's entry for it
        for dkind, shape in dict.fromkeys((k, dense_probe_shape((o, i), k)) for k, o, i in (dense_shapes or [])):
            dkey = dense_keys[shape_key(dkind, shape)] = shape_key(dkind, shape)
            if dkey not in e.setdefault("dense_rows", {}) and dkind in e["dense_rows"]:
                dense_keys[dkey] = dkind  # stated for any shape (seeded files)
                continue
            if dkey not in e["dense_rows"]:
                self.log(f"calibrating: dense {dkey} over {', '.join(map(str, DENSE_ROWS))} rows" +
                         (", fp32 and bf16" if dkind == "bf16" else ""))
                got = [dense_rows_times(shape, self.seconds / 2, kind=dkind) for _ in range(max(1, self.rounds))]
                e["dense_rows"][dkey] = {c: {r: statistics.median(g[c][r] for g in got) for r in got[0][c]}
                                         for c in got[0]}
                src[f"dense {dkey}"] = (f"median of {len(got)} rounds (1 row: "
                                        f"{min(g['fp32']['1'] for g in got) * 1e3:.3g}-"
                                        f"{max(g['fp32']['1'] for g in got) * 1e3:.3g} ms a call), {self._stamp()}")
        kv_key = f"kv {kv_dtype} {overhead_key(model_type, top_k, widths)}" if kv_dtype != "fp32" else None
        if kv_key and kv_key not in e.setdefault("kv", {}) and kv_dtype in e["kv"]:
            kv_key = kv_dtype  # stated for any model (seeded files)
        if kv_key and kv_key not in e["kv"]:
            self.log(f"calibrating: {kv_dtype} KV storage against fp32 ({kv_key})")
            got = [kv_probe(model_type, kv_dtype, self.seconds, top_k, experts, widths)
                   for _ in range(max(1, self.rounds))]
            e["kv"][kv_key] = {k: statistics.median(g[0][k] for g in got) for k in got[0][0]}
            src[kv_key] = (f"{got[0][1]}, fp32 and {kv_dtype} caches alternated, median of {len(got)} rounds "
                           f"(one-row decode per layer at {KV_CONTEXTS[-1]} tokens: " + ", ".join(
                               f"{(g[0]['decode_s'] + KV_CONTEXTS[-1] * g[0]['decode_row_s']) * 1e6:.3g}"
                               for g in got) + f" us), {self._stamp()}")
        if "gemm_flops" not in e:
            self.log("calibrating: fp32 matmul and memory bandwidth")
            (e["gemm_flops"],), s1 = rounds(lambda: gemm_rate(self.seconds / 2), self.rounds)
            (e["memory"],), s2 = rounds(lambda: memory_rate(self.seconds / 3), self.rounds)
            src["gemm_flops"], src["memory"] = f"{s1}, {self._stamp()}", f"{s2}, {self._stamp()}"
        if "page_faults" not in e:
            self.log("calibrating: page faults of fresh read buffers")
            (e["page_faults"],), s3 = rounds(lambda: page_fault_rate(self.seconds / 5), self.rounds)
            src["page_faults"] = f"{s3}, {self._stamp()}"
        if "hot_bytes" not in e:
            self.log("calibrating: fresh memory held (a VM's deep memory)")
            e["hot_bytes"], e["deep_faults"], seen = deep_fault_rates(seconds=DEEP_PROBE_S * self.seconds)
            src["deep_faults"] = f"{seen}, {self._stamp()}"
        key = overhead_key(model_type, top_k, widths)
        # a family's overhead stated without top-k or widths (seeded files) stands for all of them
        # (an overhead measured before the general-path probe existed lacks general_s: measured again)
        if all("general_s" not in e.setdefault("overhead", {}).get(k, {}) for k in (key, model_type)):
            self.log(f"calibrating: engine overhead per layer step ({key})")
            def now(hot: int) -> dict[str, float]:  # the kernel rates in each round, over the probe's working set
                got = {k: weight_rates(k, self.seconds / 3, (shapes or {}).get(k, DEFAULT_SHAPE), wide=False,
                                       nbytes=hot)[0] for k in chosen}
                if gkey:
                    got["glu"] = glu_rate(glu_shape, top_k, self.seconds / 3, nbytes=hot)
                return got

            o = overhead(model_type, self.seconds, top_k, experts, widths,
                         {k: gemv[v] for k, v in chosen.items()}, self.rounds, rate_probe=now,
                         dense_tables={k: e["dense_rows"][v] for k, v in dense_keys.items()})
            o.source += f", {self._stamp()}"
            e["overhead"][key] = asdict(o)
        _save(self.data)
        out = Rates.from_json({**e, "gemv": {k: gemv[v] for k, v in chosen.items()},
                               "expand": {k: expand[v] for k, v in chosen.items()},
                               "glu": e.get("glu_kernels", {}).get(gkey, 0.0) if gkey else 0.0,
                               "glu_rows": e.get("glu_rows", {}).get(rkey, {}) if rkey else {},
                               "dense_rows": {k: e["dense_rows"][v] for k, v in dense_keys.items()},
                               "kv": {kv_dtype: e["kv"][kv_key]} if kv_key else {}})
        for k in dense_keys:
            if f"dense {k}" in src:
                out.source[f"dense {k}"] = src[f"dense {k}"]
        if kv_key and kv_key in src:
            out.source[f"kv {kv_dtype}"] = src[kv_key]
        if gkey and gkey in src:
            out.source["glu"] = f"{gkey}: {src[gkey]}"
        if rkey and rkey in src:
            out.source["glu_rows"] = f"{rkey}: {src[rkey]}"
        out.source.update({f"gemv {k}": src.get(f"gemv {v}", "") for k, v in chosen.items()})
        out.source["shapes"] = ", ".join(chosen.values())
        return out

    def disk(self, files: list[Path], where: Path) -> tuple[float, str]:
        """Disk bytes/s for the filesystem holding `where` (probing `files`, or a scratch file there if none)."""
        probe = (lambda: disk_rate(files, self.seconds)) if files else (lambda: disk_rate_at(where, self.seconds))
        return self._disk_rate(f"{self.key}|{disk_key(where)}", "disk probe", f"direct-I/O probe of {where}", probe)

    def disk_stream(self, files: list[Path], where: Path) -> tuple[float, str]:
        """Streamed dense weights' read rate (stream_rate) on the filesystem holding `where`, cached beside `disk`'s;
        (0.0, why) where the model has no local shard to stream from (the disk rate is used)."""
        if not files:
            return 0.0, "no local shards: the disk probe's rate"
        return self._disk_rate(f"{self.key}|{disk_key(where)}|stream", "stream probe", f"stream probe of {where}",
                               lambda: stream_rate(files, self.seconds))

    def _disk_rate(self, key: str, what: str, source: str, probe: Callable[[], float]) -> tuple[float, str]:
        """A disk rate cached under `key` (probed again once per run with `fresh`): (bytes/s, its source)."""
        disks = self.data.setdefault("disks", {})
        if key not in disks or (self.fresh and key not in self.disk_done):
            self.disk_done.add(key)
            self.log(f"calibrating: {what}")
            (bw,), spread = rounds(probe, self.rounds)
            disks[key] = {"bytes_per_s": bw, "source": f"{source}, {spread}, {self._stamp()}"}
            _save(self.data)
        return disks[key]["bytes_per_s"], disks[key]["source"]

    def _stamp(self) -> str:
        self.measured.append(time.strftime("%Y-%m-%dT%H:%M:%S"))
        return f"measured {time.strftime('%Y-%m-%d %H:%M')}"
