"""Routed-expert execution: fetch the union of experts a layer step needs through the cache, run each once.

Owns the order of work in one MoE layer step: reads for missing experts are queued first (as many as the budget
has room for, the rest as room frees), resident experts compute while those reads are in flight, then each
read expert computes as it lands; the lookahead's reads for the next layer are queued behind this layer's
reads (at the reader's lower priority), promoted if the next layer routes to them and withdrawn, if not yet
started, when it does not; a warm step (no read of its own) reads ahead only for a next layer that read an expert
in one of its latest `Lookahead.quiet` steps. Also the fp32 combine (a multi-row step's pairs sorted by expert
once), the expert statistics and the phase timings. The family supplies the router output and a function computing
one expert from its tensors; this module never parses weight names.
"""
from __future__ import annotations

import atexit
import time
import weakref
from concurrent.futures import Future, wait
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator, Mapping

import torch

from moestream.config import format_bytes
from moestream.memory.accountant import MemoryAccountant
from moestream.errors import BudgetError
from moestream.experts.cache import ExpertCache
from moestream.experts.policies import HeatPolicy, POLICIES, heat_path
from moestream.experts.prefetch import Lookahead, RouterFn
from moestream.experts.reader import AHEAD, SCAN_DEPTH
from moestream.experts.store import ExpertBlob, ExpertStore
from moestream.kernels import invariant
from moestream.kernels.b12 import B12Weight
from moestream.kernels.cpu import MAX_TOKENS_BF16, bf16_native

ExpertFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
# An ExpertFn may carry `fn.accumulate(x, ids, weights, expert, rows, tensors, out) -> bool`: it adds the expert's
# weighted output for its `rows` routed rows into out itself, from the stored bytes, or declines (models/blocks).
# Several resident experts at once: (x, ids, weights, experts, their tensors, out) -> False when it declines.
# It must add exactly what _apply would add for each expert (sum of weights x expert output over its rows).
# Either may set `.pairs = True`: it also takes the batch-invariant out [T, k, D] (each pair's unweighted output at
# out[t, j], kernels/invariant.py); the runner does not hand that out to one without it.
GroupFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[dict[str, torch.Tensor]],
                    torch.Tensor], bool]
Key = tuple[int, int]
SCAN_SHARE = 0.5  # a step routing to at least this share of a layer's experts is a scan (see _scan_window)
NATIVE_MAX_ROWS = 1  # an expert over more rows than this is expanded to fp32 once and runs as one GEMM


@dataclass
class RunnerTimes:
    """Seconds the calling thread spent, per phase, inside expert steps (wall clock, summed over steps)."""

    io_wait_s: float = 0.0  # blocked on reads
    expert_s: float = 0.0  # expert functions and the weighted combine
    lookahead_s: float = 0.0  # next-layer router and queuing its reads
    steps: int = 0
    resident_steps: int = 0  # ... of which took the warm one-token path (_resident_step)
    prefetch_reads: int = 0  # experts read ahead by the lookahead
    prefetch_used: int = 0  # ... of which were routed to before being evicted
    prefetch_joined: int = 0  # misses that joined a read the lookahead had already started
    prefetch_withdrawn: int = 0  # read-ahead cancelled before it started: the layer routed elsewhere


class ExpertRunner:
    # lookahead is on by default: its reads fill the disk's idle time between layers (docs/performance.md)
    def __init__(self, store: ExpertStore, memory: MemoryAccountant, policy: str = "lfru", lookahead: bool = True,
                 moe_layers: int = 1):
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.store = store
        self.memory = memory
        pol = HeatPolicy(heat_path(store.index.root)) if policy == "heat" else POLICIES[policy]()
        self.cache = ExpertCache(memory.cache_capacity, pol, on_evict=self._on_evict)
        self.cache.on_squeeze = self._squeeze
        self.cache.on_shrunk = self._trim_idle
        memory.cache = self.cache
        self.lookahead = Lookahead(enabled=lookahead)
        # an index over a link with latency (weights/remote.py) asks for more of the predictions read ahead
        self.lookahead.reads = getattr(store.index, "lookahead_reads", self.lookahead.reads)
        self.lookahead.fill = store.fill_hook()  # ... and fetches predictions into its SSD tier (None: local)
        self.times = RunnerTimes()
        self.upcast = Upcast()
        self._inflight: dict[Key, tuple[Future, int]] = {}  # reads started, room reserved, not yet cached
        self._fresh: set[Key] = set()  # read ahead and not yet used
        self._ahead: tuple[int, int, list[int]] | None = None  # a scan's read-ahead: (layer, next layer, not queued)
        self._need: set[Key] = set()  # the running layer step's experts not computed yet
        self._quiet: dict[int, int] = {}  # MoE layer -> its latest steps in a row that read no expert (all hits)
        self.scan = 0  # this step's scan window in bytes (0: not a scanning step)
        self.moe_layers = max(1, moe_layers)  # sizes the scan window (a layer's share of all experts)
        # layer -> its resident experts' addresses for the native decode layer (models/base.py SoftmaxMoE makes
        # them, or None for a layer without one); filled here from warm steps' hits, cleared on eviction
        self.tables: dict[int, Any] = {}
        self._pairs = torch.empty(0, dtype=torch.float32)  # batch-invariant per-slot outputs (_pair_buffer)
        self._pairs_charged = 0  # ... the bytes of it charged to the budget
        if isinstance(pol, HeatPolicy):
            atexit.register(_save_heat, weakref.ref(self))

    # ---- configuration ---------------------------------------------------------------------------------
    def register_router(self, layer: int, fn: RouterFn) -> None:
        """Let the lookahead run `layer`'s router (x [T, H] -> ids [T, k]) on the previous MoE layer's input."""
        self.lookahead.register(layer, fn)

    def configure_pins(self, layer: int, share: float = 0.25) -> None:
        """Heat policy only: keep the hottest experts, `share` of what the cache can hold, last in line."""
        pol = self.cache.policy
        if isinstance(pol, HeatPolicy):
            per = self.store.resident_nbytes(layer, 0)
            pol.set_pin_count(int(share * self.memory.cache_capacity() / max(1, per)))

    # ---- one layer step --------------------------------------------------------------------------------
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fn: ExpertFn,
            out_dim: int | None = None, group: GroupFn | None = None,
            router_input: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H]; ids, weights [T, k]. Returns sum_j weights[t, j] * fn(x[t], expert ids[t, j]) as fp32 [T, D].

        With `group`, the experts already resident are computed by one grouped call (fewer, larger kernels:
        what lets a batch of sequences share a layer step); experts still being read go one by one.
        `router_input`: what this layer's router read, when the experts get something else (K3's latent MoE:
        experts see the narrow z, the routers the full-width x); the lookahead runs the next router on it."""
        if invariant.active():
            # each (row, slot)'s expert output apart, summed in slot order at the end: a row's sum then does not
            # depend on the order its experts ran in (hits first, reads as they land), nor on which call held them
            # (every pair is written: each routed expert is computed once, or the step fails)
            pairs = self._pair_buffer(x.shape[0], ids.shape[1], out_dim or x.shape[1])
            self._run(layer, x, ids, weights, fn, pairs, group, router_input)
            return invariant.combine(pairs, weights)
        out = torch.zeros(x.shape[0], out_dim or x.shape[1], dtype=torch.float32)
        return self._run(layer, x, ids, weights, fn, out, group, router_input)

    def _pair_buffer(self, t: int, k: int, d: int) -> torch.Tensor:
        """fp32 [t, k, d] for the batch-invariant per-slot outputs: one buffer for every MoE layer of an engine step
        (fresh pages each layer cost a 542-row decode step ~0.1 s of page faults). It is held through the whole
        step, beside the scratch each phase takes from the fixed allowance, so all of it is charged to the budget
        while it is held, until `end_step`."""
        need = t * k * d
        if self._pairs.numel() < need:
            charge = 4 * need
            self.memory.grow_state(charge - self._pairs_charged, "per-slot expert outputs")
            self._pairs, self._pairs_charged = torch.empty(need, dtype=torch.float32), charge
        return self._pairs[:need].view(t, k, d)

    def end_step(self) -> None:
        """The engine step is over: the per-slot output buffer goes back (to the kernel and the budget)."""
        if self._pairs.numel():
            self.memory.release_state(self._pairs_charged)
            self._pairs, self._pairs_charged = torch.empty(0, dtype=torch.float32), 0

    def _run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fn: ExpertFn,
             out: torch.Tensor, group: GroupFn | None, router_input: torch.Tensor | None) -> torch.Tensor:
        """`run` into `out`: [T, D] summed, or (batch-invariant) [T, k, D] per slot, unweighted."""
        fixed = out.dim() == 3
        if fixed and not getattr(group, "pairs", False):
            group = None  # a grouped call that only adds into [T, D]: expert by expert instead
        route_x = x if router_input is None else router_input
        if group is not None and x.shape[0] == 1 and not fixed and self._resident_step(layer, x, ids, weights, fn,
                                                                                       group, out, route_x):
            return out
        route = Routing.of(ids, weights) if x.shape[0] > 1 or fixed else None
        uniq = route.experts if route is not None else torch.unique(ids).tolist()
        if self.times.steps == 0:
            self.configure_pins(layer)
        need = self._open_step(layer, uniq)
        # experts read ahead count as reads whether or not they have landed by now (they are computed in the
        # reads' queue order below), so the fp32 sum over experts does not depend on how fast the disk was
        hits = [e for e in uniq if (layer, e) in self.cache and (layer, e) not in self._fresh]
        waiting = [e for e in uniq if (layer, e) not in self.cache or (layer, e) in self._fresh]
        reading = bool(waiting)  # (_start takes the experts it queues off `waiting`)
        self._set_scan(layer, reading, len(uniq), ids.shape[1])
        started = self._start(layer, waiting, need, evict=not self.scan)
        self._read_next(layer, route_x, need, reading, bool(waiting))
        t = time.perf_counter()
        blobs = self.cache.hits(layer, hits)  # cached and not read ahead unused: each a hit (what _use records)
        grouped = False
        if group is not None and len(hits) > 1:
            counts = {"counts": route.counts(hits)} if route is not None and getattr(group, "counts", False) else {}
            grouped = group(x, ids, weights, hits, [b.tensors() for b in blobs], out, **counts)
        for e, blob in zip(hits, blobs):
            if not grouped:
                self._apply(out, x, route or ids, weights, e, blob, fn)
            need.discard((layer, e))
            self._fill(layer, e, blob)
        self.times.expert_s += time.perf_counter() - t
        self._drain(layer, x, (out, route or ids, weights, fn), started, waiting, need, route_x)
        self._close_step()
        return out

    def _open_step(self, layer: int, uniq: list[int]) -> set[Key]:
        """A layer step of `_run` (or `rows_done`) begins: counters, the lookahead's score, this step's needs (what it
        waits on: shrinking the cache must not take its reads' room; its scan read-ahead made afresh), read-ahead it
        does not route to withdrawn and finished reads landed. Returns the needs."""
        self.times.steps += 1
        self.lookahead.observe(layer, uniq)
        need = {(layer, e) for e in uniq}
        self._ahead = None
        self._need = need
        self._withdraw(layer, need)
        self._harvest()
        return need

    def _set_scan(self, layer: int, reading: bool, routed: int, top_k: int) -> None:
        """The layer's quiet count, the step's scan window and the reader's depth for it."""
        self._quiet[layer] = 0 if reading else self._quiet.get(layer, 0) + 1
        self.scan = self._scan_window(layer, routed, top_k)
        reader = self.store.reader
        reader.set_depth(max(SCAN_DEPTH, reader.threads) if self.scan else reader.threads)

    def _read_next(self, layer: int, route_x: torch.Tensor, need: set[Key], reading: bool, waiting: bool) -> None:
        """The next layer's read-ahead once this step's own reads are queued: a scan's when nothing is left waiting,
        else the lookahead's when this step reads or the next layer may."""
        if self.scan and not waiting:
            self._scan_ahead(layer, route_x, need)
        elif not self.scan and (reading or self._next_may_read(layer)):
            self._prefetch_next(layer, route_x, need)

    def _close_step(self) -> None:
        self._trim_idle()
        self._need = set()
        self.memory.observe()

    def _resident_step(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fn: ExpertFn,
                       group: GroupFn, out: torch.Tensor, route_x: torch.Tensor) -> bool:
        """The warm decode step of one token: every routed expert cached (none read ahead and not yet used), not
        the first step; read-ahead of other experts may be in flight. Does what `run` does for that case with a
        fraction of its Python (a decode token runs this once per MoE layer); False, with nothing done, otherwise."""
        if not self.warm():
            return False
        uniq = sorted(set(ids.reshape(-1).tolist()))
        if any((layer, e) not in self.cache or (layer, e) in self._fresh for e in uniq):
            return False
        blobs = self.resident_done(layer, uniq, route_x)
        t = time.perf_counter()
        tensors = [b.tensors() for b in blobs]
        if not group(x, ids, weights, uniq, tensors, out):
            for e, blob in zip(uniq, blobs):
                self._apply(out, x, ids, weights, e, blob, fn)
        self.times.expert_s += time.perf_counter() - t
        for e, blob in zip(uniq, blobs):
            self._fill(layer, e, blob)
        return True

    def _fill(self, layer: int, e: int, blob: ExpertBlob) -> None:
        """Enter a used expert that stays cached (no longer read-ahead-unused) into the layer's table, if any."""
        table = self.tables.get(layer)
        if table is not None and (layer, e) in self.cache:
            table.fill(e, blob.tensors())

    def warm(self) -> bool:
        """Whether a one-token step whose experts are all cached (and not read ahead unused) may skip the general
        path: not the first step. Read-ahead in flight does not stop it: such a step waits on no read, and
        `resident_done` withdraws and lands the read-ahead as the general path would."""
        return self.times.steps > 0

    def resident_done(self, layer: int, uniq: list[int], route_x: torch.Tensor) -> list[ExpertBlob]:
        """The bookkeeping of a warm one-token step whose routed experts `uniq` (ascending) are all cached and
        none read ahead unused, computed by the caller (the grouped call above, or the native decode layer from
        self.tables after the fact): counters, the lookahead's score and next reads, the policy's touches and
        the hit statistics. With read-ahead in flight, first what the general path does before its hits: withdraw
        the read-ahead of this and earlier layers not started (this step routed elsewhere) and land finished reads.
        Returns the experts' blobs."""
        cache = self.cache
        self._count_resident(layer, uniq)
        self.scan = 0
        need = None
        if self._inflight:
            need = {(layer, e) for e in uniq}
            self.store.reader.set_depth(self.store.reader.threads)
            self._withdraw(layer, need)
            self._harvest(need)
        if self._next_may_read(layer):
            self._prefetch_next(layer, route_x, need or {(layer, e) for e in uniq})
        blobs = cache.hits(layer, uniq)
        self.memory.observe()
        return blobs

    def resident_run(self, layers: list[int], routed: list[list[int]], route_x: torch.Tensor) -> None:
        """`resident_done` for consecutive layers of one decode token that ran their routed experts from the tables
        in one native run (DecoderModel.decode_layers), in layer order: routed[i] the ids layers[i] routed to,
        route_x[i] its router input. None but the last may read (the caller checked `reads_after` before the run)."""
        last = len(layers) - 1
        for i, (layer, ids) in enumerate(zip(layers, routed)):
            uniq = sorted(set(ids))
            if i == last or self._inflight:  # the one that may read, and what it left in flight
                self.resident_done(layer, uniq, route_x[i:i + 1])
                continue
            # resident_done for a layer that reads nothing (no read-ahead in flight, `reads_after` False): the
            # counters, the lookahead's score and the touches, without the blobs; nothing is allocated between a
            # run's layers, so the accountant's peak is observed by the last one's
            self._count_resident(layer, uniq)
            self.cache.touch_hits(layer, uniq)

    def rows_done(self, layer: int, uniq: list[int], route_x: torch.Tensor, top_k: int) -> None:
        """The bookkeeping of a multi-row step (a short prompt chunk) whose routed experts `uniq` (ascending) were
        all in the layer's table, computed by the caller (the native rows block, models/base.py Layer._rows): what
        `_run` does for a step whose experts all hit, without the compute (counters, the lookahead's score, read-ahead
        withdrawn and landed, the quiet count, the scan window and the read-ahead it or the lookahead start, the
        policy's touches and the hit statistics, the idle buffers trimmed). Experts in the table are cached and
        not read ahead unused, so every one is a hit, as `_run` would find."""
        need = self._open_step(layer, uniq)
        self._set_scan(layer, False, len(uniq), top_k)
        self._read_next(layer, route_x, need, False, False)
        self.cache.touch_hits(layer, uniq)
        self._close_step()

    def _count_resident(self, layer: int, uniq: list[int]) -> None:
        """A warm one-token step's counters, its layer's quiet count and the lookahead's score of it."""
        self.times.steps += 1
        self.times.resident_steps += 1
        self._quiet[layer] = self._quiet.get(layer, 0) + 1
        self.lookahead.observe(layer, uniq)

    def reads_after(self, layer: int) -> bool:
        """Whether the bookkeeping of a warm one-token step of `layer` (`resident_done`) may start or land reads:
        read-ahead is in flight, or the lookahead would read the next layer's experts. A native run of several
        layers (DecoderModel.decode_layers) ends after such a layer."""
        return bool(self._inflight) or self._next_may_read(layer)

    def _next_may_read(self, layer: int) -> bool:
        """Whether a step that waits on no read of its own runs the next layer's router to read ahead: not with
        every expert of every routed layer cached (nothing is left to read), nor for a next layer whose latest
        `lookahead.quiet` steps read nothing (`_quiet_next`). A warm decode step and a multi-row step whose
        experts were all cached (a warm prefill chunk: on the peer checkpoint the 16-token prefill ran the next
        router on each of its 32 layer steps, 3.9 ms of its 209) both ask this."""
        return (len(self.cache) < len(self.lookahead.routers) * self.store.num_experts
                and not self._quiet_next(layer))

    def _quiet_next(self, layer: int) -> bool:
        """Whether the MoE layer after `layer` needed no read (every routed expert cached and used before) in each
        of its latest `lookahead.quiet` steps, so a warm step reads nothing ahead for it. A step of that layer
        that reads starts its count again; the general path (a step waiting on reads) always reads ahead. Not with a
        remote checkpoint's fetch-ahead: its predictions reach past the next layer."""
        quiet = self.lookahead.quiet
        if not quiet or self.lookahead.fill is not None:
            return False
        nxt = self.lookahead.next_layer(layer)
        return nxt is not None and self._quiet.get(nxt, 0) >= quiet

    def _start(self, layer: int, experts: list[int], need: set[Key], evict: bool = True,
               idle: bool = True) -> dict[Future, int]:
        """Queue reads for `experts` while room can be reserved (evicting only if `evict`); returns future ->
        expert. Started experts are removed from `experts` (the caller keeps the rest for later). `idle`: nothing
        of this layer step is in flight, so a head with no room takes it from later read-ahead (_give_back)."""
        started: dict[Future, int] = {}
        while experts:
            e = experts[0]
            key = (layer, e)
            if key in self.cache:  # read ahead and landed: its turn comes in this order, as if read now
                landed: Future = Future()
                landed.set_result(None)
                started[landed] = e
            elif key in self._inflight:  # the lookahead already queued this read: it is now awaited
                self.times.prefetch_joined += 1
                self.store.reader.promote(self._inflight[key][0])
                started[self._inflight[key][0]] = e
            else:
                nbytes, keep = self.store.resident_nbytes(layer, e), frozenset(need)
                if not self.cache.reserve(nbytes, keep, evict) and (
                        started or not idle or not self._give_back(layer, experts[1:], nbytes, keep, evict)):
                    break
                self._inflight[key] = (self.store.submit(layer, e), nbytes)
                started[self._inflight[key][0]] = e
            experts.pop(0)
        return started

    def _give_back(self, layer: int, later: list[int], nbytes: int, keep: frozenset, evict: bool) -> bool:
        """Nothing of this layer is started and the next expert's read has no room: reads ahead of experts later
        in the queue hold it. Cancel (or drop, if landed) them from the last one back until the room is reserved;
        each is read again in its turn, so the experts are still summed in queue order. True once reserved."""
        for e in reversed(later):
            key = (layer, e)
            if key in self._inflight:
                if not self._cancel(key):
                    continue
            elif key in self._fresh and key in self.cache:
                self.cache.drop(key)
            else:
                continue
            if self.cache.reserve(nbytes, keep, evict):
                return True
        return False

    def _drain(self, layer: int, x: torch.Tensor, work: tuple, started: dict[Future, int], waiting: list[int],
               need: set[Key], route_x: torch.Tensor) -> None:
        """Compute each read expert once it lands, in queue order; start the rest of `waiting` as computed experts
        free room. `work` is (out, routing or ids, weights, fn) for `_apply`; `route_x` is what the next layer's
        router reads ahead from."""
        out, ids, weights, fn = work
        while started or waiting:
            if not started:
                self.finish(need)  # read-ahead in flight holds room: land it so it becomes evictable
                started = self._start(layer, waiting, need)
                if not started:
                    self._budget_error(self.store.resident_nbytes(layer, waiting[0]))
            # in the order the reads were queued (ascending expert id), not the order they finish: the fp32 sum
            # over experts is then the same in every run with the same cache state (bit-reproducible cold runs)
            fut = next(iter(started))
            t = time.perf_counter()
            fut.exception()  # waits; a failed read raises from _land
            self.times.io_wait_s += time.perf_counter() - t
            t = time.perf_counter()
            e = started.pop(fut)
            blob = self._land((layer, e), need) if (layer, e) in self._inflight else self.cache.get((layer, e))
            self._use(layer, e, hit=False)
            self._apply(out, x, ids, weights, e, blob, fn)
            need.discard((layer, e))
            self._spill((layer, e))
            self._fill(layer, e, blob)
            self.times.expert_s += time.perf_counter() - t
            if waiting:
                started.update(self._start(layer, waiting, need, evict=not self.scan, idle=not started))
            if self.scan and not waiting:  # each computed expert's room goes on to the next layer's reads
                self._scan_ahead(layer, route_x, need)

    def _land(self, key: Key, need: set[Key]) -> ExpertBlob:
        """A finished read becomes a cache entry (or, if the budget shrank meanwhile, is used once and dropped)."""
        fut, nbytes = self._inflight.pop(key)
        try:
            blob = fut.result()
        except BaseException:
            self.cache.release(nbytes)
            raise
        if not self.cache.put(key, blob, nbytes, keep=frozenset(need), reserved=True):
            self._fresh.discard(key)
        return blob

    def _withdraw(self, layer: int, need: set[Key]) -> None:
        """Cancel read-ahead for this or an earlier layer that this step does not route to and that has not
        started: its room goes back to the cache and the disk to the reads this step waits on."""
        for key in [k for k in self._inflight if k[0] <= layer and k not in need]:
            self._cancel(key)

    def _cancel(self, key: Key) -> bool:
        """Cancel a read in flight that has not started: its room goes back to the cache. False if it started."""
        fut, nbytes = self._inflight[key]
        if not self.store.reader.cancel(fut):
            return False
        del self._inflight[key]
        self.cache.release(nbytes)
        self._fresh.discard(key)
        self.times.prefetch_withdrawn += 1
        return True

    def _trim_idle(self) -> None:
        """After a layer step, and when state growth evicted experts: buffers evicted beyond what was re-used go back
        to the OS, except during a scan: there up to the window of free room stays mapped for the next layer's reads
        (a fresh buffer faults in and zeroes every page before the read lands: a quarter of a 256-request job's CPU
        was system time). Idle buffers beyond the cache's free room would lie outside the budget: a 1,025-row
        batch-invariant prompt step held 156 MiB of them beside books 75 MiB short of the budget."""
        self.store.reader.pool.trim(min(self.scan, max(0, self.cache.free())))

    def _squeeze(self) -> None:
        """State grew while reads ahead held booked room the budget no longer has: cancel those not started, land
        the others (they become entries the cache can evict, or are dropped); the running layer step's own reads
        keep their room."""
        for key in [k for k in self._inflight if k not in self._need]:
            if self._cancel(key):
                continue
            self._inflight[key][0].exception()  # waits; a failed read is dropped here and read again when a step needs it
            try:
                self._land(key, set(self._need))
            except Exception:  # noqa: BLE001
                self._fresh.discard(key)

    def _harvest(self, need: set[Key] = frozenset()) -> None:
        """Move finished lookahead reads into the cache (only this thread touches the cache)."""
        for key in [k for k, (f, _) in self._inflight.items() if f.done()]:
            try:
                self._land(key, set(need))
            except Exception:  # noqa: BLE001 - a failed read-ahead is retried as an ordinary miss
                self._fresh.discard(key)

    def _use(self, layer: int, e: int, hit: bool) -> None:
        key = (layer, e)
        if key in self._fresh:  # the cache did not hold it before the lookahead: a miss the prefetch covered
            self._fresh.discard(key)
            self.times.prefetch_used += 1
            hit = False
        self.cache.stats.record(layer, hit)

    def _prefetch_next(self, layer: int, x: torch.Tensor, need: set[Key]) -> None:
        if not self.lookahead.routers:
            return
        t = time.perf_counter()
        pred = self.lookahead.predict(layer, x, self.store.num_experts)
        if pred is not None:
            nxt, experts = pred
            issued = 0
            for e in experts:
                key = (nxt, e)
                if issued >= self.lookahead.reads:
                    break
                if key in self.cache or key in self._inflight:
                    continue
                nbytes = self.store.resident_nbytes(nxt, e)
                if not self.cache.reserve(nbytes, frozenset(need)):
                    break
                self._inflight[key] = (self.store.submit(nxt, e, AHEAD), nbytes)
                self._fresh.add(key)
                self.times.prefetch_reads += 1
                issued += 1
        self.times.lookahead_s += time.perf_counter() - t

    # ---- large batches: every expert of a layer each step --------------------------------------------------
    def _scan_window(self, layer: int, routed: int, top_k: int) -> int:
        """Bytes kept free for reads in flight when this step routes to most of the layer's experts, else 0.

        A step of many sequences needs nearly every expert of every layer, a cyclic scan that any recency
        policy answers with no hits at all (each expert is evicted just before its next use). Scanning steps
        therefore never evict to read: what is resident stays, and experts read for the step (or ahead of it)
        are dropped after use once less than this window is free, so the hit rate is the cache's share of the
        experts instead of zero."""
        if routed < SCAN_SHARE * self.store.num_experts:
            return 0
        return scan_window(self.store.resident_nbytes(layer, 0), self.store.num_experts, top_k, self.moe_layers,
                           self.memory.cache_capacity())

    def _spill(self, key: Key) -> None:
        if self.scan and self.cache.free() < self.scan:
            self.cache.drop(key)

    def _scan_ahead(self, layer: int, x: torch.Tensor, need: set[Key]) -> None:
        """All of this layer's reads are queued: queue the next MoE layer's experts (its router on this layer's
        input, run once a layer step) into the free room, at the reader's lower priority, so the disk works while
        this layer computes; called again as each computed expert frees room, it goes on down the same list, with
        at most the scan window read ahead and not landed (beyond it, read-ahead took room the resident set needed:
        on the tiny checkpoint's 40-sequence test the hit rate fell from 0.20 to 0.12 and the bytes read rose 10%)."""
        if not self.lookahead.enabled:
            return
        t = time.perf_counter()
        if self._ahead is None or self._ahead[0] != layer:  # once a layer step; later calls go on down the list
            nxt = self.lookahead.next_layer(layer)
            if nxt is None:
                return
            self._ahead = (layer, nxt, torch.unique(self.lookahead.routers[nxt](x)).tolist())
        _, nxt, experts = self._ahead
        keep = frozenset(need)
        ahead = sum(nb for k, (_, nb) in self._inflight.items() if k[0] == nxt)  # read ahead and not landed yet
        while experts:
            key = (nxt, experts[0])
            if key not in self.cache and key not in self._inflight:
                nbytes = self.store.resident_nbytes(nxt, key[1])
                if ahead + nbytes > self.scan or not self.cache.reserve(nbytes, keep, evict=False):
                    break
                ahead += nbytes
                self._inflight[key] = (self.store.submit(nxt, key[1], AHEAD), nbytes)
                self._fresh.add(key)
                self.times.prefetch_reads += 1
            experts.pop(0)
        self.times.lookahead_s += time.perf_counter() - t

    def _on_evict(self, key: Key, blob: ExpertBlob) -> None:
        self._fresh.discard(key)
        table = self.tables.get(key[0])
        if table is not None:
            table.drop(key[1])
        self.store.recycle(blob)

    def _budget_error(self, nbytes: int) -> None:
        raise BudgetError(
            f"the RAM budget leaves {format_bytes(self.memory.cache_capacity())} for experts, less than one "
            f"expert ({format_bytes(nbytes)}): raise --ram-budget"
        )

    def finish(self, need: set[Key] = frozenset()) -> None:
        """Wait for read-ahead still in flight and cache it (so buffers are accounted, not orphaned)."""
        wait([f for f, _ in self._inflight.values()])
        self._harvest(need)

    def save_heat(self) -> None:
        if isinstance(self.cache.policy, HeatPolicy):
            self.cache.policy.save()

    def _apply(self, out: torch.Tensor, x: torch.Tensor, route: "Routing | torch.Tensor", weights: torch.Tensor,
               e: int, blob: ExpertBlob, fn: ExpertFn) -> None:
        if isinstance(route, Routing):
            rows, w = route.pairs(e)
        else:
            rows, slots = torch.nonzero(route == e, as_tuple=True)
            w = weights[rows, slots].unsqueeze(-1).float()
        n = rows.numel()
        acc = getattr(fn, "accumulate", None)
        if out.dim() == 3 and not getattr(acc, "pairs", False):
            acc = None  # it adds into [T, D] only
        if acc is not None and isinstance(route, Routing) and acc(x, route.ids, route.raw, e, n, blob.tensors(), out):
            return  # a fused native GLU over up to a few dozen rows, from the stored bytes, added in place
        # one row: the native GEMV reads the stored bytes; more rows: expanded once to fp32 for one GEMM over all
        # of them (docs/performance.md)
        y = fn(x.index_select(0, rows), self.upcast(blob.tensors(), n if n <= NATIVE_MAX_ROWS else None)).float()
        if out.dim() == 3:  # batch-invariant per-slot outputs (the expert function's own kernels decide its bits)
            out[rows, route.slots(e)] = y
            return
        out.index_add_(0, rows, y * w)


def scan_window(expert: int, experts: int, top_k: int, layers: int, capacity: int) -> int:
    """Free room a scanning step keeps for reads: about one layer's misses and a half, so that the next layer's
    reads (queued by _scan_ahead) keep the disk busy while this layer computes. The smaller the window, the more
    experts stay resident (fewer bytes per step) but the sooner the read-ahead stops: with room for 2 x top_k
    experts (48 MB on the peer, whose layer misses are ~150 MB at a 1.35 GB cache) the disk sat idle 2.5 s of a
    9.2 s B=256 step.
    At least 2 x top_k experts; at most a quarter of the cache, so most of it stays resident."""
    layer = expert * experts
    misses = layer * max(0.0, 1.0 - capacity / (layer * layers))  # a layer's share of what is not resident
    return int(max(2 * top_k * expert, min(1.5 * misses, capacity / 4)))


class Routing:
    """A multi-row step's (row, slot) pairs sorted by expert once (one stable sort instead of a compare and a
    nonzero per expert): each expert's pairs are one contiguous slice, rows ascending as nonzero would give them, so
    its GEMM sees the same input and the combine adds the same products in the same order. `of` makes only the
    step's experts and their spans; the per-pair tensors (rows, weights, slots) and the routing as the kernels take
    it (ids, raw) are made on first use: a step whose resident experts all go to one grouped call, which groups the
    pairs itself, needs none of them (a warm 16-token prefill spent ~0.2 ms a layer step making them)."""

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, experts: list[int],
                 spans: dict[int, slice]):
        self.experts, self._spans = experts, spans
        self._ids, self._weights, self._order = ids, weights, order  # the routing as given; the pairs' sorted order

    @classmethod
    def of(cls, ids: torch.Tensor, weights: torch.Tensor) -> "Routing":
        flat = ids.reshape(-1)
        ordered, order = torch.sort(flat, stable=True)
        experts, counts = torch.unique_consecutive(ordered, return_counts=True)
        spans, end = {}, 0
        for e, n in zip(experts.tolist(), counts.tolist()):
            spans[e] = slice(end, end + n)
            end += n
        return cls(ids, weights, order, list(spans), spans)

    @cached_property
    def rows(self) -> torch.Tensor:
        """Each sorted pair's row [pairs] (int64)."""
        return torch.div(self._order, self._ids.shape[1], rounding_mode="floor")

    @cached_property
    def weights(self) -> torch.Tensor:
        """Each sorted pair's routing weight [pairs, 1] fp32."""
        return self._weights.reshape(-1)[self._order].float().unsqueeze(-1)

    @cached_property
    def pair_slots(self) -> torch.Tensor:
        """Each sorted pair's slot (top-k rank) [pairs]."""
        return self._order % self._ids.shape[1]

    @cached_property
    def ids(self) -> torch.Tensor:
        """The step's routing as given: ids [T, k] int64 contiguous."""
        return self._ids.long().contiguous()

    @cached_property
    def raw(self) -> torch.Tensor:
        """The step's routing weights as given, [T, k] fp32 contiguous."""
        return self._weights.float().contiguous()

    def counts(self, experts: list[int]) -> list[int]:
        """The pairs routed to each of `experts` (each one of this step's experts)."""
        spans = self._spans
        return [spans[e].stop - spans[e].start for e in experts]

    def slots(self, e: int) -> torch.Tensor:
        """The slots (top-k ranks) of the pairs routed to `e`, in the order of `pairs(e)`'s rows."""
        return self.pair_slots[self._spans[e]]

    def pairs(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows routed to `e` (ascending) and their routing weights [n, 1] fp32."""
        span = self._spans[e]
        return self.rows[span], self.weights[span]


class Upcast:
    """Expands a bf16/f16 expert into one reused fp32 buffer (the accountant's compute scratch) as it computes.

    `linear` upcasts per use anyway; doing it into the same buffer every time keeps those short-lived megabyte
    allocations out of the malloc heap, where they fragment it and hold hundreds of MB of RSS beyond the
    budget. Same fp32 values, so the same results. Each part is expanded when the expert function first asks
    for it (right before its matmul, while the bytes are hot). Experts with any quantised part (uint8, int32,
    fp8) pass through untouched: their kernels want the stored bytes. So do bf16 experts that `linear`'s native
    kernel will take for `tokens` rows (it reads the bf16 bytes directly: expanding them would cost the upcast
    it saves).
    """

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32)

    def __call__(self, tensors: dict[str, torch.Tensor], tokens: int | None = None) -> Mapping[str, torch.Tensor]:
        if not all(t.dtype in _FLOATS or type(t) is B12Weight for t in tensors.values()):
            return tensors
        half = [t for t in tensors.values() if t.dtype != torch.float32]
        if tokens is not None and half and all(_stays(t, tokens) for t in half) \
                and any(t.dim() == 2 or type(t) is B12Weight for t in half):
            return tensors
        need = sum(_numel(t) for t in tensors.values() if t.dtype != torch.float32)
        if need == 0:
            return tensors
        if self.buf.numel() < need:
            self.buf = torch.empty(need, dtype=torch.float32)
        return _Expanded(tensors, self.buf)


class _Expanded(Mapping):
    """A read-only view of an expert's tensors whose bf16/f16 parts expand into slices of `buf` on first use."""

    def __init__(self, tensors: dict[str, torch.Tensor], buf: torch.Tensor):
        self._src, self._buf, self._done = tensors, buf, {}
        self._slots, off = {}, 0
        for name, t in tensors.items():
            if t.dtype != torch.float32:
                self._slots[name] = off
                off += _numel(t)

    def __getitem__(self, name: str) -> torch.Tensor:
        got = self._done.get(name)
        if got is None:
            t = self._src[name]
            if name in self._slots:
                off = self._slots[name]
                if type(t) is B12Weight:  # decoded a bounded slab of rows at a time, the same values as bf16's
                    t = t.expand_into(self._buf[off:off + _numel(t)].view(t.out_features, t.in_features))
                else:
                    t = self._buf[off:off + t.numel()].view(t.shape).copy_(t)
            got = self._done[name] = t
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._src)

    def __len__(self) -> int:
        return len(self._src)


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _numel(t: torch.Tensor) -> int:
    return t.out_features * t.in_features if type(t) is B12Weight else t.numel()


def _stays(t: torch.Tensor, tokens: int) -> bool:
    """Whether a half-precision part is left as stored for `tokens` rows: a bf16 matrix the native kernel takes
    (bf16_native), a b12 one for the rows the native kernels take its bf16 twin, so that both take the same path
    and give the same bits; a part of another rank never needs the expansion."""
    if type(t) is B12Weight:
        return tokens <= MAX_TOKENS_BF16
    return t.dim() != 2 or bf16_native(t, tokens=tokens)


def _save_heat(ref: "weakref.ref[ExpertRunner]") -> None:
    runner = ref()
    if runner is not None:
        runner.save_heat()
