"""The planner's timing model: decode, prefill and batch-step time from a checkpoint's facts, a budget's residency
plan, a routing-skew assumption and a machine's rates.

Owns the arithmetic `moestream plan` prints, term by term (docs/plan.md states it):
- I/O per step: experts not in the cache x expert bytes, plus streamed dense bytes, at the disk's bandwidth;
- compute per step: weights touched at the one-row kernel's byte rate (a layer's bf16 GLU experts at the rate of
  the fused native call that runs them together; a multi-row step: expanded to fp32 at the expansion rate plus
  rows x FLOPs at the fp32 GEMM rate), sequence state read at memory bandwidth, attention
  FLOPs at the GEMM rate; bf16 dense weights over several rows (and the large ones, the lm_head among them, at
  one row) at the dense probe's measured times at the model's own shapes, in bf16 compute (--compute-dtype bf16)
  from 16 rows a step, the routed bf16 GLU experts at the fused call's bf16 many-row times from
  blocks.BF16_GLU_MIN_ROWS (16); the
  --kv-dtype cache's measured work beyond fp32's (quantise on write, dequantise on read);
- the engine's fixed cost per layer step (calibrated);
- the CPU cost of each expert read on a miss of a one-row step (one sequence's decode), beyond its multiply:
  the engine's per-miss work (calibrated by decoding the overhead probe's checkpoint under a budget where most
  experts miss) plus faulting in its read buffer's fresh pages (calibrated); it counts as compute. A multi-row step
  (a batch, a prompt chunk) is charged the per-miss engine work (landing, bookkeeping, the spill) on its main
  thread but no page faults (a scan keeps its buffers mapped), and its read experts' calls are priced at their
  rows;
- a cold start: one stream of an engine just opened also misses the cached set's experts its prompt did not
  route to, on their first use (skew.first_use, averaged over the generated tokens);
- overlap, a one-row step (one sequence's decode): layer by layer, as the engine runs it (experts/dispatch.py):
  a MoE layer step with m misses queues their reads after its mixer and router, computes its hits and then each
  read expert as it lands, so its expert phase lasts max(main-thread work, the reads + the last expert's work);
  the reads: the first buffer's page faults, then m x expert bytes at the disk's rate. Layer steps without a miss
  wait for nothing. The number of misses per layer step is a distribution (the replayed routing's, else binomial
  around the mean), not its mean: one miss in a layer step cannot hide behind much, several hide behind each
  other's work (`layer_waits`). The step is the longer of all its reads and that sum (streamed dense reads share
  the disk);
- a multi-row step (a batch, a prompt chunk), layer by layer (`batch_timeline`): the main thread runs each MoE
  layer's mixer, router and overhead, its hits in one grouped call while its misses' reads run, then each read
  expert as it lands; the disk serves the reads in queue order; a scanning step holds at most its read window
  of reads and reads the next layer's ahead into the free room once its own are queued. bf16 GLU experts at the
  fused call's measured many-row times (calibrate.glu_rows_times), other formats by fp32 expansion + GEMM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from moestream.info import BudgetFit
from moestream.experts.dispatch import NATIVE_MAX_ROWS, SCAN_SHARE, scan_window
from moestream.kernels.cpu import MAX_TOKENS_BF16, MAX_TOKENS_MXFP4
from moestream.kernels.quant import FP8_NATIVE_MAX_T, INT4_NATIVE_MAX_T
from moestream.models.blocks import BF16_GLU_MIN_ROWS, BF16_MIN_ROWS
from moestream.planner.calibrate import DENSE_KINDS, Rates, interp_rows, nearest_dense
from moestream.planner.facts import ModelFacts
from moestream.planner.skew import (Skew, binomial_spread, distinct, first_use, replay_batch, replay_decode,
                                     single_row, split_cache)
from moestream.weights.pages import huge_bytes

# quantised weights kernels.quant multiplies natively up to its row limits, dense or expert alike (MXFP4; block-FP8
# and int4 on kernels/_cpu_fp8.c)
QUANT_ROWS = {"mxfp4": MAX_TOKENS_MXFP4, "fp8": FP8_NATIVE_MAX_T - 1, "int4": INT4_NATIVE_MAX_T - 1}
NATIVE_ROWS = {"bf16": MAX_TOKENS_BF16, **QUANT_ROWS}  # rows the one-row kernels take in one pass
# rows a routed expert runs in the one-row kernel: bf16 experts over more rows are expanded to fp32 once
# (experts/dispatch.py)
EXPERT_ROWS = {"bf16": NATIVE_MAX_ROWS, **QUANT_ROWS}
# a dense bf16 weight of at least this many bytes is priced at one row by the dense probe at its own shape (K3's
# MLP, g / o projections, lm_head: a GEMV of that size is its streaming rate at that shape); smaller ones by the
# one-row kernel's rate at hidden x hidden, which the overhead probe's subtraction uses too
DENSE_OWN_MIN_BYTES = 16 << 20


@dataclass
class Step:
    """One engine step's predicted seconds, by term."""

    io_s: float
    compute_s: float
    overhead_s: float
    expert_reads: float  # experts read from disk (all layers)
    hit_rate: float
    parts: dict[str, float] = field(default_factory=dict)  # compute_s by term (experts, dense, attention, state)
    # the seconds the step's layer steps wait for their own reads beyond their work: a one-row step's from
    # layer_waits (the step is then overhead + max(io, compute + wait)); a multi-row step's from its timeline
    wait_s: float | None = None
    # a multi-row step: its length from the layer-by-layer timeline of reads and main-thread work (batch_timeline:
    # overhead, compute and the waits in it, the disk's reads beside them); None: a one-row step
    timeline_s: float | None = None
    detail: dict = field(default_factory=dict)  # a multi-row step's per-layer terms, for the plan's output
    # a one-row step's streamed lm_head: (seconds its slabs take to read, its compute, in compute_s): read after
    # the last layer, each slab while the one before computes, so it overlaps nothing of the layers
    head_tail: tuple[float, float] = (0.0, 0.0)

    @property
    def seconds(self) -> float:
        if self.timeline_s is not None:
            return self.timeline_s
        read, head = self.head_tail
        return (self.overhead_s + max(self.io_s - read, self.compute_s - head + (self.wait_s or 0.0))
                + max(read, head))


def batch_timeline(layers: int, misses: float, front: float, hits_s: float, read_s: float, miss_s: float,
                   window: float | None, dense_s: float = 0.0, tail: float = 0.0) -> tuple[float, float, float]:
    """(step seconds, main-thread seconds, disk-busy seconds) of a multi-row step's `layers` MoE layer steps as
    ExpertRunner.run runs them (experts/dispatch.py), every layer alike: the main thread does `front` (mixer,
    router, the engine's overhead), computes the layer's hits in one grouped call (`hits_s`), then each read
    expert as it lands, in queue order (`miss_s` each); the disk serves reads one after another at `read_s` each
    (the reader's threads share its bandwidth). Each layer step has `misses` reads on average (whole reads,
    spread over the layers so that they sum to layers x misses). A read holds room from its queueing until its
    expert is computed (a scan drops it then): with a `window` (a scanning step: experts.dispatch.scan_window,
    in experts) at most that many reads are held at once, the rest queued as computed experts free room, and once
    all of a layer's reads are queued the free room goes to the next layer's reads (_scan_ahead: read ahead while
    this layer computes); None (a step that evicts to read): all of a layer's reads queue at its start, none
    ahead. `dense_s`: streamed dense reads per layer step, queued one layer ahead (DenseStreamer), which the
    layer's main-thread work waits for. `tail`: main-thread work after the last layer (the lm_head); nothing
    reads across steps (the lookahead has no layer after the last); the fraction of a read that whole reads per
    layer leave out is read and computed at the end."""
    n = max(1, layers)
    counts = [int(math.floor((j + 1) * misses + 1e-9)) - int(math.floor(j * misses + 1e-9)) for j in range(n)]
    t = disk = busy = cpu = 0.0
    room = math.inf if window is None else max(1.0, float(window))
    ahead: list[float] = []  # completion times of reads queued for the next layer step, in queue order
    dense_done = 0.0
    if dense_s > 0:  # the first layer's streamed weights, read when the step starts
        disk, busy, dense_done = dense_s, dense_s, dense_s

    def read(at: float) -> float:
        nonlocal disk, busy
        disk = max(disk, at) + read_s
        busy += read_s
        return disk

    for j in range(n):
        t = max(t, dense_done)
        if dense_s > 0 and j + 1 < n:  # the next layer's streamed weights go on the disk now
            dense_done = disk = max(disk, t) + dense_s
            busy += dense_s
        t += front
        cpu += front
        m = counts[j]
        nxt = counts[j + 1] if j + 1 < n and window is not None else 0
        mine, ahead = ahead[:m], []
        held = len(mine)
        while len(mine) < m and held < room:  # this layer's reads, as room allows
            mine.append(read(t))
            held += 1
        queued = len(mine)
        while queued == m and len(ahead) < nxt and held < room:  # all queued: read the next layer's ahead
            ahead.append(read(t))
            held += 1
        t += hits_s
        cpu += hits_s
        for i in range(m):
            t = max(t, mine[i]) + miss_s
            cpu += miss_s
            held -= 1  # its room goes to the next read
            while queued < m and held < room:
                mine.append(read(t))
                queued += 1
                held += 1
            while queued == m and len(ahead) < nxt and held < room:
                ahead.append(read(t))
                held += 1
    # the fraction of a read the whole reads leave out (layers x misses is not whole): its work at the end
    frac = max(0.0, n * misses - sum(counts))
    t, cpu, busy = max(t + frac * miss_s, disk + frac * read_s), cpu + frac * miss_s, busy + frac * read_s
    return t + tail, cpu + tail, busy


@dataclass
class Scenario:
    """A budget on a machine: the cache it leaves and the rates that price each byte and FLOP."""

    facts: ModelFacts
    fit: BudgetFit
    rates: Rates
    skew: Skew
    replayed: str = ""  # what decode replayed of the skew's recorded routing (empty: the analytic model)
    replayed_batch: str = ""  # what a batch's decode replayed of it (empty: the analytic model)
    compute_dtype: str = "fp32"  # --compute-dtype: "bf16" prices many-row steps' bf16 products at the bf16 probes
    huge_pages: bool = False  # the engine here holds resident dense weights on huge pages (weights.pages.enabled)

    @property
    def residency(self):
        return self.fit.residency

    def huge_dense_bytes(self) -> float:
        """Bytes of the resident dense weights on transparent huge pages (with `huge_pages`): each matrix's whole 2
        MiB stretches (weights/pages.py), their share of the dense matrices' bytes (the lm_head's among them) applied
        to the resident dense bytes. On this VM such pages come from the deep pool (the memory its host took back),
        not from the hot pool a read buffer's 4 KiB pages take first (docs/plan.md, "Dense weights on huge pages take
        the deep pool"), so they do not count toward the fresh memory the read buffers fault against."""
        if not self.huge_pages:
            return 0.0
        f = self.facts
        mats = [(DENSE_KINDS.get(kind, 2) * o * i, n) for (kind, o, i), n in f.dense_shapes.items()]
        if f.head_shape is not None:
            mats.append((DENSE_KINDS.get(f.head_kind, 2) * f.head_shape[0] * f.head_shape[1], 1))
        total = sum(size * n for size, n in mats)
        huge = sum(huge_bytes(size) * n for size, n in mats)
        return self.residency.resident_dense_bytes * huge / total if total else 0.0

    def cached_per_layer(self, state_bytes: float = 0.0) -> float:
        """Experts a layer keeps cached (the cache shared evenly by the MoE layers), after `state_bytes` of
        sequence state grew into the cache's room."""
        room = max(0.0, self.fit.cache_bytes - state_bytes)
        fit = min(self.fit.experts_total, room / max(1.0, self.fit.resident_bytes_per_expert))
        return fit / max(1, self.facts.moe_layers)

    def _overhead(self, kind: str, rows: int = 1) -> float:
        o = self.rates.overhead_for(self.facts.model_type, self.facts.top_k, self.facts.widths)
        if o is None:
            return 0.0
        if kind == "prefill":
            per = o.prefill_s
        elif rows > 1 and any(line := o.batch_line(self.compute_dtype)):  # a multi-row step, measured on that path
            per = line[0] + line[1] * rows
        else:
            per = o.decode_s + o.decode_row_s * max(0, rows - 1)
        return per * self.facts.num_layers

    def _weights(self, nbytes: float, kind: str, params: float, rows: float, limit: dict = NATIVE_ROWS) -> float:
        """Seconds to multiply `rows` activation rows through weights of `nbytes` stored bytes and `params`
        parameters: the one-row kernel's byte rate (extra rows it takes in the same pass at the GEMM rate), or,
        above its row limit, expansion to fp32 and a GEMM."""
        r = self.rates
        if rows <= limit.get(kind, 1):
            return nbytes / r.gemv[kind] + 2.0 * params * (rows - 1) / r.gemm_flops
        return self._expanded(nbytes, kind, params, rows)

    def _expanded(self, nbytes: float, kind: str, params: float, rows: float) -> float:
        """Expansion to fp32, then a GEMM bound by reading the fp32 copy or by its FLOPs, whichever is longer."""
        r = self.rates
        gemm = max(4.0 * params / r.memory, 2.0 * params * rows / r.gemm_flops)
        return nbytes / r.expand.get(kind, r.expand["bf16"]) + gemm

    def expert_rate(self) -> float:
        """Bytes/s of one row through a routed expert: a bf16 GLU expert runs with the layer's others in one fused
        native call (calibrate.glu_rate), other formats through their one-row kernel."""
        r = self.rates
        return r.glu if self.facts.expert_kind == "bf16" and r.glu > 0 else r.gemv[self.facts.expert_kind]

    def bf16_experts(self, step_rows: float) -> bool:
        """Whether a step of `step_rows` rows runs its routed bf16 GLU experts in bf16 compute (--compute-dtype
        bf16 from blocks.BF16_GLU_MIN_ROWS rows a step) with the bf16 many-row times measured."""
        return (self.compute_dtype == "bf16" and step_rows >= BF16_GLU_MIN_ROWS
                and bool(self.rates.glu_rows.get("group_bf16")))

    def expert_time(self, rows: float, grouped: bool, step_rows: float = 0.0) -> float | None:
        """Seconds of one bf16 GLU expert over `rows` rows in a multi-row step of `step_rows` rows, by the fused
        call's measured times (calibrate.glu_rows_times: `grouped`, a layer step's resident experts in one call;
        else a read expert's own call; in bf16 compute where `bf16_experts(step_rows)`), linear between the probed
        row counts (fp32: one row at the fused decode rate; bf16: below its first probed count at that count's
        time, the panel kernel's lanes idle) and beyond the last; None where not measured or not a bf16
        expert."""
        f = self.facts
        bf16 = self.bf16_experts(step_rows)
        name = ("group" if grouped else "single") + ("_bf16" if bf16 else "")
        table = self.rates.glu_rows.get(name) if f.expert_kind == "bf16" else None
        if not table:
            return None
        probed = sorted((float(k), v) for k, v in table.items() if float(k) > 1)
        pts = ([(1.0, probed[0][1])] if bf16 else [(1.0, f.expert_bytes / self.expert_rate())]) + probed
        for i in range(1, len(pts)):  # more rows never take less time (a probe slowed by load at fewer rows)
            pts[i] = (pts[i][0], max(pts[i][1], pts[i - 1][1]))
        x = max(1.0, rows)
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1 or (x1, y1) == pts[-1]:
                return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
        return pts[0][1]

    def miss_cost(self) -> float:
        """Main-thread seconds one expert read on a miss of a one-row step costs beyond a hit's: the family's
        per-miss engine work (landing, the one-expert path, eviction) and its multiply by the one-expert kernel
        instead of the layer's fused call."""
        f = self.facts
        o = self.rates.overhead_for(f.model_type, f.top_k, f.widths)
        one = f.expert_bytes / self.rates.gemv.get(f.expert_kind, self.rates.gemv["bf16"])
        return (o.miss_s if o is not None else 0.0) + max(0.0, one - f.expert_bytes / self.expert_rate())

    def fault_seconds_per_byte(self, taken: float) -> float:
        """Seconds a byte of a fresh read buffer costs to fault in once the process holds `taken` bytes of fresh
        memory: the calibrated fresh-page rate up to the machine's hot memory (calibrate.deep_fault_rates), its
        deep-memory rate from twice that, linear between (the hot pool's size moves by 0.5-1 GiB between probes
        here, and peer's fills at 1.4x it paid 4.4 ms a 3 MiB read, 0.45 of the way from 1.1 to 8: docs/plan.md,
        "Deep memory"). 0 where neither rate is measured."""
        r = self.rates
        hot = 1.0 / r.page_faults if r.page_faults > 0 else 0.0
        if r.deep_faults <= 0 or r.hot_bytes <= 0:
            return hot
        share = min(1.0, max(0.0, taken / r.hot_bytes - 1.0))
        return hot + share * max(0.0, 1.0 / r.deep_faults - hot)

    def layer_waits(self, spread: dict[int, float], partial: bool, fill: float = 1.0,
                    taken: float = 0.0) -> tuple[float, float]:
        """(main-thread seconds beyond the warm step, seconds waiting for reads) of the MoE layer steps of one
        one-row step, from `spread`: the share of layer steps with m misses. A layer step with m >= 1 misses leaves
        the warm path (`general_s`, which holds the lookahead router: with a `partial` cache every layer step runs
        that anyway, counted apart) and works m x miss_cost more; it queues the m reads after its mixer and
        router, computes its k - m hits, then each read expert as it lands (experts/dispatch.py, run / _drain):
        its expert phase lasts max(that work, reads + the last expert's work), the reads being the first buffer's
        page faults then m x expert bytes at the disk's rate. A read into free room takes a fresh buffer, which the
        reader faults in before the disk fills it (the later ones fault while earlier reads are on the disk); a
        read that evicts reuses the evicted expert's buffer (experts/reader.py BufferPool: by size, and a model's
        experts share one size): `fill` is the share of misses that fill free room, their pages priced by
        fault_seconds_per_byte at `taken` bytes of fresh memory held."""
        f, r = self.facts, self.rates
        o = r.overhead_for(f.model_type, f.top_k, f.widths)
        general = o.general_s if o is not None else 0.0
        ahead = o.lookahead_s if o is not None and partial else 0.0
        hit = f.expert_bytes / self.expert_rate()
        miss = self.miss_cost()
        last = miss + hit  # the last read expert's work, after its read lands
        pages = fill * f.expert_bytes * self.fault_seconds_per_byte(taken)
        read = f.expert_bytes / r.disk if r.disk > 0 else 0.0
        cpu = wait = 0.0
        for m, share in spread.items():
            if m <= 0 or share <= 0:
                continue
            work = general + f.top_k * hit + m * miss  # the layer step's expert phase on the main thread
            cpu += share * (max(0.0, general - ahead) + m * miss)
            wait += share * max(0.0, pages + m * read + last - work)
        return f.moe_layers * cpu, f.moe_layers * wait

    def dense_time(self, shape: tuple[int, int], rows: float, kind: str = "bf16") -> float | None:
        """Seconds of one bf16 or block-FP8 (`kind`) dense weight of `shape` (out, in) over `rows` rows, from the
        dense probe (calibrate.dense_rows_times) at the probed shape of that format nearest in size, scaled by the
        parameters' ratio, linear between the probed row counts and beyond the last; bf16 weights in bf16 compute
        (--compute-dtype bf16) from blocks.BF16_MIN_ROWS rows. None where no dense shape was probed."""
        tables = self.rates.dense_rows
        got = nearest_dense(tables, shape, kind)
        if got is None:
            return None
        by = tables[got[0]]
        mode = "bf16" if self.compute_dtype == "bf16" and rows >= BF16_MIN_ROWS and by.get("bf16") else "fp32"
        if not by.get(mode):
            return None
        return interp_rows(by[mode], rows) * got[1]

    def _dense_shapes(self, rows: float) -> tuple[float, dict[str, float], float]:
        """(seconds, bytes by format, parameters) of the dense weights the dense probe prices at `rows` rows: every
        bf16 and block-FP8 dense weight over several rows; at one row only those of DENSE_OWN_MIN_BYTES or more (the
        smaller ones keep the one-row kernel's rate: the engine's decode layer multiplies them in fused native
        calls, whose per-call cost the overhead probe measures)."""
        t, nbytes, params = 0.0, {}, 0.0
        for (kind, o, i), n in self.facts.dense_shapes.items():
            size = DENSE_KINDS.get(kind, 0) * o * i
            if not size or (rows <= 1 and size < DENSE_OWN_MIN_BYTES):
                continue
            got = self.dense_time((o, i), rows, kind)
            if got is None:
                continue
            t += n * got
            nbytes[kind] = nbytes.get(kind, 0.0) + n * float(size)
            params += n * o * i
        return t, nbytes, params

    def _head(self, rows: float) -> float:
        """The lm_head over `rows` rows: the dense probe at its shape where measured (several rows, or one row of a
        head of DENSE_OWN_MIN_BYTES or more), else the format's one-row / expansion rule."""
        f = self.facts
        if f.head_shape is not None and f.head_kind in DENSE_KINDS \
                and (rows > 1 or f.head_bytes >= DENSE_OWN_MIN_BYTES):
            got = self.dense_time(f.head_shape, rows, f.head_kind)
            if got is not None:
                return got
        return self._weights(f.head_bytes, f.head_kind, f.head_params, rows)

    def _dense(self, rows: int, head_rows: int) -> float:
        f = self.facts
        t, probed, probed_params = self._dense_shapes(rows)
        rest_params = max(0.0, f.dense_params - probed_params)
        rest = {k: max(0.0, b - probed.get(k, 0.0)) for k, b in f.dense_bytes.items()}
        rest_total = sum(rest.values()) or 1.0
        t += sum(self._weights(b, k, rest_params * b / rest_total, rows) for k, b in rest.items() if b > 0)
        return t + self._head(head_rows)

    def _kv(self, sequences: int, context: float, prompt_tokens: int = 0) -> float:
        """The `--kv-dtype` storage's work beyond fp32's (calibrate.kv_costs: quantise on write, dequantise on
        read) per step, over the layers with a KV / latent cache: one-row decode, a batch decode step of
        `sequences`, or a prompt chunk of `prompt_tokens`; 0 for fp32 or where not measured."""
        f = self.facts
        k = self.rates.kv.get(f.state.kv_dtype) if f.state.kv_dtype != "fp32" else None
        if not k:
            return 0.0
        layers = len(f.attention)
        if prompt_tokens:
            return layers * k.get("prefill_token_s", 0.0) * prompt_tokens
        if sequences <= 1:
            return layers * (k.get("decode_s", 0.0) + k.get("decode_row_s", 0.0) * context)
        return sequences * layers * (k.get("batch_s", 0.0) + k.get("batch_row_s", 0.0) * context)

    def _attention(self, rows: int, context: float) -> float:
        """Score and value FLOPs of `rows` queries over `context` keys, plus KDA's per-token state update."""
        f = self.facts
        flops = sum(2.0 * rows * context * h * (qk + v) for h, qk, v in f.attention)
        layers, heads, dim = f.kda
        flops += 4.0 * rows * layers * heads * dim * dim
        return flops / self.rates.gemm_flops

    def _state_read(self, sequences: int, context: float) -> float:
        s = self.facts.state
        return sequences * (s.bytes_per_token * context + 2 * s.fixed_bytes) / self.rates.memory

    def _stream_rate(self) -> float:
        """Bytes/s of streamed dense reads (layers into their kept slots, the head's slabs into their kept buffers:
        engine/residency.py): the stream probe's (Rates.disk_stream) where measured, else the disk's."""
        return self.rates.disk_stream or self.rates.disk

    def _streamed(self) -> float:
        """Seconds a step reads its streamed dense weights (layers and the head's slabs)."""
        return self.residency.streamed_bytes_per_step / self._stream_rate() if self.rates.disk > 0 else 0.0

    def _head_read(self) -> float:
        """Seconds a step reads the streamed lm_head's slabs (the rows it does not keep resident), 0 when resident."""
        r = self.residency
        if not r.head_streamed or self.rates.disk <= 0:
            return 0.0
        return r.head_stream_bytes / self._stream_rate()

    def _multi(self, used: float, missing: float, rows: float, fallback: float, parts: dict[str, float],
               head: float, overhead: float, window: float | None, step_rows: float = 0.0) -> Step:
        """A multi-row step (a batch, a prompt chunk) layer by layer (batch_timeline): per MoE layer step `used`
        distinct experts, `missing` of them read, `rows` rows each on average; the hits in one grouped call, each
        read expert in its own call as it lands, at the fused GLU call's measured many-row times (bf16 GLU
        experts), else `fallback` seconds a layer step for all of them (fp32 expansion + GEMM) shared by expert.
        `parts`: the other compute (dense weights with the lm_head's `head` among them, attention, state);
        `overhead`: the engine's fixed work; both on the main thread, before each layer's experts, the head
        after the last. `window`: a scanning step's read window in experts (None: a step that evicts)."""
        f, r = self.facts, self.rates
        hits = max(0.0, used - missing)
        group, single = self.expert_time(rows, True, step_rows), self.expert_time(rows, False, step_rows)
        if group is None or single is None:
            group = single = fallback / max(1e-9, used)
        # a read expert's engine work beyond its call: landing, the policy's bookkeeping, the spill, queueing the
        # next read (the overhead probe's per-miss work, which also holds a small expert call's fixed cost)
        o = r.overhead_for(f.model_type, f.top_k, f.widths)
        land = o.miss_s if o is not None else 0.0
        hits_s, miss_s = hits * group, single + land
        layers = max(1, f.moe_layers)
        other = sum(parts.values())
        front = (other - head + overhead) / layers
        read = f.expert_bytes / r.disk if r.disk > 0 else 0.0
        head_read = self._head_read()
        dense = (self._streamed() - head_read) / layers  # the head's slabs: after the last layer
        total, cpu, busy = batch_timeline(layers, missing, front, hits_s, read, miss_s, window, dense,
                                          max(head, head_read))
        experts = layers * (hits_s + missing * miss_s)
        parts = {**parts, "experts_s": experts, "misses_s": 0.0}
        compute = sum(parts.values())
        io = layers * missing * read + self._streamed()
        detail = {"experts_per_layer_step": used, "reads_per_layer_step": missing, "rows_per_expert": rows,
                  "hit_expert_s": group, "read_expert_s": single, "read_engine_s": land, "read_s": read,
                  "read_window_experts": window, "disk_busy_share": busy / total if total > 0 else 0.0,
                  "expert_rates": ("fused GLU many-row probe" + (", bf16 compute" if self.bf16_experts(step_rows)
                                                                   else "")
                                   if self.expert_time(rows, True, step_rows) is not None
                                   else "fp32 expansion + GEMM")}
        return Step(io, compute, overhead, layers * missing, max(0.0, 1.0 - missing / max(1e-9, used)), parts,
                    max(0.0, total - compute - overhead), total, detail)

    # ---- the three predictions ------------------------------------------------------------------------------
    def decode(self, sequences: int, context: float, state_bytes: float = 0.0,
               since_open: tuple[int, int] | None = None) -> Step:
        """One decode step of `sequences` sequences (one new token each) at `context` tokens of context.
        `since_open` = (prompt, generated) tokens of one stream since the engine opened with an empty cache: the
        step then also misses, on average over the generated tokens, the cached set's experts no earlier token
        has used (skew.first_use: a cold start's compulsory reads, which the steady state does not have)."""
        f, s = self.facts, self.skew
        laws = s.laws(f.num_experts, f.moe_layers)
        shares = split_cache(laws, f.num_experts, f.top_k, self.cached_per_layer(state_bytes))
        used = missing = one = 0.0
        per_law = []  # each layer's mean misses a step
        for law, cached in zip(laws, shares):  # per layer, averaged (one law: every layer alike)
            u, m = distinct(f.num_experts, f.top_k, law, sequences, cached, s.reuse)
            if since_open is not None and since_open[1] > 0:
                m += first_use(f.num_experts, f.top_k, law, cached, since_open[0], sequences, since_open[1])
            per_law.append(m)
            used, missing = used + u / len(laws), missing + m / len(laws)
            one += single_row(f.num_experts, f.top_k, law, sequences) / len(laws)
        capacity = int(self.cached_per_layer(state_bytes) * f.moe_layers)
        spread, fills = None, None  # share of layer steps by their number of misses (one-row steps); of fills
        if since_open is not None and since_open[1] > 0 and sequences == 1 and s.replayable(f.num_experts,
                                                                                            f.moe_layers):
            # the model's own recorded routing through the engine's cache policy, from an empty cache
            spread, fills = {}, []
            per_token, _, self.replayed = replay_decode(s.routing, capacity, *since_open, spread=spread, fills=fills)
            missing = min(used, per_token / max(1, f.moe_layers))
        elif (since_open is not None and since_open[1] > 0 and sequences > 1
              and s.replayable(f.num_experts, f.moe_layers)
              and (got := replay_batch(s.routing, capacity, since_open[0], since_open[1], sequences, f.num_experts,
                                       scan_share=SCAN_SHARE)) is not None):
            # the recorded routing of `sequences` independent prompts decoding together, from an empty cache: each
            # sequence's own experts stay cached for its next tokens (a pooled popularity misses that)
            per_step, used, _, self.replayed_batch = got
            missing = min(used, per_step / max(1, f.moe_layers))
        elif used >= SCAN_SHARE * f.num_experts and capacity < f.num_experts * f.moe_layers:
            # a scanning step (a batch routing to most of every layer's experts): the engine evicts nothing to read
            # (experts/dispatch.py, _scan_window), so the cache keeps what it held, bar a window for reads in
            # flight, whatever their popularity: each resident expert is one of this step's with the step's share
            window = scan_window(1, f.num_experts, f.top_k, f.moe_layers, capacity)
            missing = used * (1.0 - max(0, capacity - window) / (f.num_experts * f.moe_layers))
        multi = max(0.0, used - one)
        rows = max(0.0, sequences * f.top_k - one) / max(1e-9, multi)  # mean rows of a multi-row expert
        experts = f.moe_layers * (one * f.expert_bytes / self.expert_rate()
                                  + multi * self._weights(f.expert_bytes, f.expert_kind, f.expert_params, rows,
                                                          EXPERT_ROWS))
        reads = f.moe_layers * missing
        if sequences > 1:
            scan = used >= SCAN_SHARE * f.num_experts and capacity < f.num_experts * f.moe_layers
            window = scan_window(1, f.num_experts, f.top_k, f.moe_layers, capacity) if scan else None
            parts = {"dense_s": self._dense(sequences, sequences), "attention_s": self._attention(sequences, context),
                     "state_s": self._state_read(sequences, context), "kv_s": self._kv(sequences, context)}
            head = self._head(sequences)
            return self._multi(used, missing, sequences * f.top_k / max(1e-9, used), experts / f.moe_layers, parts,
                               head, self._overhead("decode", sequences), window, sequences)
        parts = {"experts_s": experts, "dense_s": self._dense(sequences, sequences),
                 "attention_s": self._attention(sequences, context), "state_s": self._state_read(sequences, context),
                 "kv_s": self._kv(sequences, context), "misses_s": 0.0}
        wait = None
        if sequences == 1:
            # the lookahead router runs in every layer step while the cache lacks any expert: always from open
            partial = capacity < f.num_experts * f.moe_layers or (since_open is not None and since_open[1] > 0)
            if spread is None:  # no replay: each layer's misses binomial around its own mean
                spread = {}
                for m in per_law:
                    for n, share in binomial_spread(f.top_k, m).items():
                        spread[n] = spread.get(n, 0.0) + share / len(per_law)
            o = self.rates.overhead_for(f.model_type, f.top_k, f.widths)
            parts["lookahead_s"] = f.moe_layers * o.lookahead_s if partial and o is not None else 0.0
            room = self.cached_per_layer(state_bytes)
            prompt = ([distinct(f.num_experts, f.top_k, law, since_open[0])[0] for law in laws]
                      if since_open is not None and since_open[1] > 0 else [])
            if fills:
                fill = fills[0]
            else:  # misses fill free room while the cache is not full: it holds every expert, or a cold start's
                # prompt has not routed to as many distinct experts as a layer's share
                fill = 1.0 if room >= f.num_experts or (prompt and min(prompt) < room) else 0.0
            # fresh memory taken by then: all the budget holds but the cache, and the experts the prompt cached
            held = min(room, sum(prompt) / len(prompt)) if prompt else room
            fit = self.fit
            taken = fit.ram_budget - fit.cache_bytes - self.huge_dense_bytes() \
                + held * f.moe_layers * fit.resident_bytes_per_expert
            parts["misses_s"], wait = self.layer_waits(spread, partial, fill, taken)
        io = reads * f.expert_bytes / self.rates.disk + self._streamed() if self.rates.disk > 0 else 0.0
        hit = max(0.0, 1.0 - missing / max(1e-9, used))
        head_read = self._head_read()
        tail = (head_read, self._head(sequences)) if head_read > 0 else (0.0, 0.0)
        return Step(io, sum(parts.values()), self._overhead("decode", sequences), reads, hit, parts, wait,
                    head_tail=tail)


    def prefill(self, tokens: int, chunk: int, cold: bool) -> list[Step]:
        """The steps of one prompt of `tokens` tokens fed `chunk` at a time; `cold`: the expert cache starts
        empty (the first request after open), else it holds its steady share."""
        f, s = self.facts, self.skew
        law = s.law(f.num_experts)
        steps, done, cap = [], 0, self.cached_per_layer()
        while done < tokens:
            n = min(chunk, tokens - done)
            cached = min(cap, distinct(f.num_experts, f.top_k, law, done)[0]) if cold else cap
            used, missing = distinct(f.num_experts, f.top_k, law, n, cached)
            rows = n * f.top_k / max(1e-9, used)
            experts = used * self._weights(f.expert_bytes, f.expert_kind, f.expert_params, rows, EXPERT_ROWS)
            capacity = int(cap * f.moe_layers)
            scan = used >= SCAN_SHARE * f.num_experts and capacity < f.num_experts * f.moe_layers
            window = scan_window(1, f.num_experts, f.top_k, f.moe_layers, capacity) if scan else None
            head = self._head(1)
            parts = {"dense_s": self._dense(n, 1), "attention_s": self._attention(n, done + n / 2),
                     "kv_s": self._kv(1, done + n / 2, n)}
            steps.append(self._multi(used, missing, rows, experts, parts, head, self._overhead("prefill"), window, n))
            done += n
        return steps
