"""The planner's timing model: decode, prefill and batch-step time from a checkpoint's facts, a budget's residency
plan, a routing-skew assumption and a machine's rates.

Owns the arithmetic `moestream plan` prints, term by term (docs/plan.md states it):
- I/O per step: experts not in the cache x expert bytes, plus streamed dense bytes, at the disk's bandwidth;
- compute per step: weights touched at the one-row kernel's byte rate (a layer's bf16 GLU experts at the rate of
  the fused native call that runs them together; a multi-row step: expanded to fp32 at the expansion rate plus
  rows x FLOPs at the fp32 GEMM rate), sequence state read at memory bandwidth, attention
  FLOPs at the GEMM rate;
- the engine's fixed cost per layer step (calibrated);
- the CPU cost of each expert read on a miss of a one-row step (one sequence's decode), beyond its multiply:
  the engine's per-miss work (calibrated by decoding the overhead probe's checkpoint under a budget where most
  experts miss) plus faulting in its read buffer's fresh pages (calibrated; the reader threads do it beside the
  compute, so OVERLAP of it is hidden); it counts as compute. A multi-row step (a batch, a prompt chunk) lands
  its reads while other experts compute, and a scan keeps its buffers mapped: not charged (the batch rows of
  docs/plan.md fit without it);
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
- overlap, a multi-row step (a batch, a prompt chunk): step = overhead + max(io, compute) + (1 - OVERLAP) x
  min(io, compute).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moestream.info import BudgetFit
from moestream.experts.dispatch import NATIVE_MAX_ROWS, SCAN_SHARE, scan_window
from moestream.kernels.cpu import MAX_TOKENS_BF16, MAX_TOKENS_MXFP4
from moestream.planner.calibrate import Rates
from moestream.planner.facts import ModelFacts
from moestream.planner.skew import (Skew, binomial_spread, distinct, first_use, replay_decode, single_row,
                                     split_cache)

# Share of the shorter of I/O and compute hidden behind the longer: reads of a layer's missing experts run while
# its resident experts compute and the lookahead reads one expert ahead, but attention and dense work mostly wait.
OVERLAP = 0.5
NATIVE_ROWS = {"bf16": MAX_TOKENS_BF16, "mxfp4": MAX_TOKENS_MXFP4}  # rows the one-row kernels take in one pass
# rows a routed expert runs in the one-row kernel: bf16 experts over more rows are expanded to fp32 once
# (experts/dispatch.py); MXFP4 experts go through kernels.quant, native up to its row limit
EXPERT_ROWS = {"bf16": NATIVE_MAX_ROWS, "mxfp4": MAX_TOKENS_MXFP4}


@dataclass
class Step:
    """One engine step's predicted seconds, by term."""

    io_s: float
    compute_s: float
    overhead_s: float
    expert_reads: float  # experts read from disk (all layers)
    hit_rate: float
    parts: dict[str, float] = field(default_factory=dict)  # compute_s by term (experts, dense, attention, state)
    # a one-row step: the seconds its layer steps wait for their own reads beyond their work (layer_waits); the
    # step is then overhead + max(io, compute + wait). None: a multi-row step, the OVERLAP rule
    wait_s: float | None = None

    @property
    def seconds(self) -> float:
        if self.wait_s is not None:
            return self.overhead_s + max(self.io_s, self.compute_s + self.wait_s)
        longer, shorter = max(self.io_s, self.compute_s), min(self.io_s, self.compute_s)
        return self.overhead_s + longer + (1.0 - OVERLAP) * shorter


@dataclass
class Scenario:
    """A budget on a machine: the cache it leaves and the rates that price each byte and FLOP."""

    facts: ModelFacts
    fit: BudgetFit
    rates: Rates
    skew: Skew
    replayed: str = ""  # what decode replayed of the skew's recorded routing (empty: the analytic model)

    @property
    def residency(self):
        return self.fit.residency

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
        per = o.prefill_s if kind == "prefill" else o.decode_s + o.decode_row_s * max(0, rows - 1)
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

    def miss_cost(self) -> float:
        """Main-thread seconds one expert read on a miss of a one-row step costs beyond a hit's: the family's
        per-miss engine work (landing, the one-expert path, eviction) and its multiply by the one-expert kernel
        instead of the layer's fused call."""
        f = self.facts
        o = self.rates.overhead_for(f.model_type, f.top_k, f.widths)
        one = f.expert_bytes / self.rates.gemv.get(f.expert_kind, self.rates.gemv["bf16"])
        return (o.miss_s if o is not None else 0.0) + max(0.0, one - f.expert_bytes / self.expert_rate())

    def layer_waits(self, spread: dict[int, float], partial: bool, fill: float = 1.0) -> tuple[float, float]:
        """(main-thread seconds beyond the warm step, seconds waiting for reads) of the MoE layer steps of one
        one-row step, from `spread`: the share of layer steps with m misses. A layer step with m >= 1 misses leaves
        the warm path (`general_s`, which holds the lookahead router: with a `partial` cache every layer step runs
        that anyway, counted apart) and works m x miss_cost more; it queues the m reads after its mixer and
        router, computes its k - m hits, then each read expert as it lands (experts/dispatch.py, run / _drain):
        its expert phase lasts max(that work, reads + the last expert's work), the reads being the first buffer's
        page faults then m x expert bytes at the disk's rate. A read into free room takes a fresh buffer, which the
        reader faults in before the disk fills it (the later ones fault while earlier reads are on the disk); a
        read that evicts reuses the evicted expert's buffer (experts/reader.py BufferPool: by size, and a model's
        experts share one size): `fill` is the share of misses that fill free room."""
        f, r = self.facts, self.rates
        o = r.overhead_for(f.model_type, f.top_k, f.widths)
        general = o.general_s if o is not None else 0.0
        ahead = o.lookahead_s if o is not None and partial else 0.0
        hit = f.expert_bytes / self.expert_rate()
        miss = self.miss_cost()
        last = miss + hit  # the last read expert's work, after its read lands
        pages = fill * f.expert_bytes / r.page_faults if r.page_faults > 0 else 0.0
        read = f.expert_bytes / r.disk if r.disk > 0 else 0.0
        cpu = wait = 0.0
        for m, share in spread.items():
            if m <= 0 or share <= 0:
                continue
            work = general + f.top_k * hit + m * miss  # the layer step's expert phase on the main thread
            cpu += share * (max(0.0, general - ahead) + m * miss)
            wait += share * max(0.0, pages + m * read + last - work)
        return f.moe_layers * cpu, f.moe_layers * wait

    def _dense(self, rows: int, head_rows: int) -> float:
        f = self.facts
        total_bytes = sum(f.dense_bytes.values()) or 1
        t = sum(self._weights(b, k, f.dense_params * b / total_bytes, rows) for k, b in f.dense_bytes.items())
        return t + self._weights(f.head_bytes, f.head_kind, f.head_params, head_rows)

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

    def _streamed(self) -> float:
        return self.residency.streamed_bytes_per_step / self.rates.disk if self.rates.disk > 0 else 0.0

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
        parts = {"experts_s": experts, "dense_s": self._dense(sequences, sequences),
                 "attention_s": self._attention(sequences, context), "state_s": self._state_read(sequences, context),
                 "misses_s": 0.0}
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
            if fills:
                fill = fills[0]
            else:  # misses fill free room while the cache is not full: it holds every expert, or a cold start's
                # prompt has not routed to as many distinct experts as a layer's share
                room = self.cached_per_layer(state_bytes)
                fill = 1.0 if room >= f.num_experts or (since_open is not None and since_open[1] > 0 and min(
                    distinct(f.num_experts, f.top_k, law, since_open[0])[0] for law in laws) < room) else 0.0
            parts["misses_s"], wait = self.layer_waits(spread, partial, fill)
        io = reads * f.expert_bytes / self.rates.disk + self._streamed() if self.rates.disk > 0 else 0.0
        hit = max(0.0, 1.0 - missing / max(1e-9, used))
        return Step(io, sum(parts.values()), self._overhead("decode", sequences), reads, hit, parts, wait)


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
            experts = f.moe_layers * used * self._weights(f.expert_bytes, f.expert_kind, f.expert_params, rows,
                                                          EXPERT_ROWS)
            reads = f.moe_layers * missing
            compute = self._dense(n, 1) + experts + self._attention(n, done + n / 2)
            io = reads * f.expert_bytes / self.rates.disk + self._streamed() if self.rates.disk > 0 else 0.0
            steps.append(Step(io, compute, self._overhead("prefill"), reads, max(0.0, 1.0 - missing / max(1e-9, used))))
            done += n
        return steps
