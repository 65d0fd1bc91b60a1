"""Continuous batching: one thread owns the engine; requests come in through a queue, tokens go out through theirs.

Each iteration admits waiting requests, gives prefilling requests at most `prefill_chunk` prompt tokens in total,
advances every active sequence in one `engine.step` (a layer reads the union of their experts once), then samples
per request, detokenizes, matches stop strings and hands events to the request's asyncio queue. It never imports
torch: logits are used only through their own methods. Prefix reuse and cloning live in prefix.py. A handler never
waits on a dead thread or past --request-timeout (Ticket.next), and `drain` stops admission for a graceful shutdown.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moestream.engine.engine import LOGIT_CHUNK_ROWS
from moestream.engine.sampling import SamplingParams, sample, sample_rows
from moestream.errors import BudgetError, RequestError
from moestream.memory.state import transient
from moestream.server.prefix import PrefixCache, StateProfile, clone_state
from moestream.server.protocol import GenRequest, TokenLogprob, Usage
from moestream.server.stops import StopMatcher
from moestream.server.scoring import PromptScorer
from moestream.server.structured import GuideFactory
from moestream.server.tickets import Delta, Done, Failed, Outbox, QueueFull, Ticket, Unavailable, err_type
from moestream.server.tools import KeepingTokenizer
from moestream.tokenizer import StreamDecoder, Tokenizer


@dataclass
class SchedulerConfig:
    max_batch: int = 16
    max_queue: int = 64
    prefill_chunk: int = 256  # prompt tokens per iteration, across all prefilling requests
    prefix_cache_bytes: int = 0  # 0 disables prefix reuse
    rate_window_s: float = 10.0
    request_timeout_s: float | None = None  # a request still running after this gets a 504 and is cancelled
    # budget admission keeps for the expert cache beyond what sequences' state may grow to (None: 2 x top_k
    # experts, room for a layer step's reads in flight); the rest bounds how many sequences run at once
    expert_room: int | None = None


STATS_EVERY_S = 0.25  # while streams run, /metrics engine figures are at most this old


# `_draw_ahead` samples rows together with at most this many bytes of temporaries at once (SAMPLE_ROW_COPIES fp32
# copies of a row: the stacked logits, scaled, log-softmax, probabilities, and their float64 running sum): 16 rows
# of an 8k vocabulary, 1 of a 160k one (Kimi K3).
SAMPLE_ROWS_BYTES = 4 << 20
SAMPLE_ROW_COPIES = 8


@dataclass(eq=False)
class _Seq:
    """One admitted request while it runs (scheduler thread only). Compared by identity: `seq in self.active` must
    not compare every field of ~1,000 sequences a step (the generated dataclass __eq__ did)."""

    ticket: Ticket
    state: Any
    todo: list[int]  # prompt tokens not yet fed
    fed: list[int]  # tokens the state holds
    reused: int
    decoder: StreamDecoder
    matcher: StopMatcher
    gen: Any = None  # torch.Generator when sampling
    reserve: int = 0  # state bytes this sequence may grow to (admission counts it from the start)
    next_token: int | None = None
    generated: int = 0
    held: list[TokenLogprob] = field(default_factory=list)
    last_at: float = 0.0  # when its previous token was sampled (inter-token latency)
    index: int = 0  # which of the request's `n` choices
    guide: Any = None  # structured.Guide: grammar / logit_bias constraint, None when unconstrained
    scorer: PromptScorer | None = None  # echo with logprobs: scores the prompt while it is prefilled
    prompt_entries: list[TokenLogprob] = field(default_factory=list)
    prefilled: bool = False
    waited: int = 0  # steps in a row it was ready to decode but left out for room (goes first next time)


class Scheduler:
    def __init__(self, engine, tokenizer: Tokenizer, cfg: SchedulerConfig):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.eos = set(tokenizer.eos_token_ids) | set(engine.eos_token_ids)
        self.prefix = PrefixCache(cfg.prefix_cache_bytes) if cfg.prefix_cache_bytes > 0 else None
        self.profile = StateProfile()
        self._drawn: dict[_Seq, int] = {}  # tokens `_draw_ahead` sampled for this step's rows, taken by `_advance`
        # State never squeezes the expert cache below one expert: a layer step could not run at all.
        self.expert_reserve = engine.plan.max_expert_bytes
        room = cfg.expert_room if cfg.expert_room is not None else engine.plan.layer_reads_bytes
        self.expert_room = max(self.expert_reserve, room)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: deque[Ticket] = deque()
        self.active: list[_Seq] = []
        self._queued = 0
        self._lock = threading.Lock()
        self._stop = False
        self.draining = False
        self.observe: Callable[[str, float], None] = lambda what, seconds: None  # timings for /metrics
        self._rate: deque[tuple[float, int]] = deque()
        self.counters = dict(requests=0, tokens_generated=0, prompt_tokens=0, prompt_tokens_reused=0, failed=0,
                             cancelled=0, steps=0, widest_step=0, sampled_together=0)
        # widest_step: most sequences in one step; sampled_together: tokens `_draw_ahead` drew several rows at once
        self.engine_stats: dict = {}
        self._stats_at = 0.0
        self._ended = False  # a request ended in this iteration
        self.outbox = Outbox()
        self.guides = GuideFactory(tokenizer, engine.vocab_size, sorted(self.eos))
        self.thread = threading.Thread(target=self._run, name="moestream-scheduler", daemon=True)

    # ---- the handlers' side (event loop thread) -------------------------------------------------------------
    def start(self) -> "Scheduler":
        # the process is the scheduler's: RSS beyond the books displaces experts, down to the room it plans for them
        self.engine.watch_resident(self.expert_room)
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self.inbox.put(("wake", None))
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, req: GenRequest) -> Ticket:
        if self.draining:
            raise Unavailable("the server is shutting down and takes no new requests")
        if not self.alive:
            raise Unavailable("the server's scheduler thread is not running; restart the server")
        ticket = Ticket(req, asyncio.get_running_loop(), self.outbox, lambda: self.thread.is_alive(),
                        self.cfg.request_timeout_s)
        with self._lock:
            if self._queued >= self.cfg.max_queue:
                raise QueueFull(f"{self._queued} requests are already waiting (--max-queue {self.cfg.max_queue})")
            self._queued += 1
        self.inbox.put(("submit", ticket))
        return ticket

    def drain(self) -> None:
        """Stop admitting: later `submit`s raise Unavailable; the requests already in finish (see `idle`)."""
        self.draining = True

    @property
    def idle(self) -> bool:
        """Nothing submitted, waiting or running (read from the drain thread: each look is atomic under the GIL)."""
        return self._queued == 0 and not self.active and self.inbox.empty()

    def cancel(self, ticket: Ticket) -> None:
        if not ticket.finished:
            self.inbox.put(("cancel", ticket.id))

    def snapshot(self) -> dict:
        """Plain numbers for /metrics (refreshed by the scheduler thread after every step)."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._rate) if now - t <= self.cfg.rate_window_s]
        span = max(1e-9, now - recent[0][0]) if recent else 1.0
        return {**self.counters, **self.engine_stats, "queue_depth": self._queued, "active_sequences": len(self.active),
                "tokens_per_second": sum(n for _, n in recent) / span if len(recent) > 1 else 0.0,
                "prefix_cache_bytes": self.prefix.bytes if self.prefix else 0,
                "prefix_cache_entries": len(self.prefix) if self.prefix else 0}

    # ---- the owner thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                try:
                    self._iterate()
                except Exception as e:  # never let one bad iteration kill the server: fail what was running
                    for seq in list(self.active):
                        self._fail(seq, 500, f"internal error: {type(e).__name__}: {e}")
                self._publish()  # after the except too: those failures reach their clients now, not next iteration
        finally:  # stopped, or killed by something worse than an Exception: nobody is left waiting
            self._close()

    def _close(self) -> None:
        for seq in list(self.active):
            self._fail(seq, 503, "the server is shutting down")
        self._drain(block=False)
        while self.waiting:
            self.waiting.popleft().put(Failed(503, "the server is shutting down"))
            self._dequeued()
        self.outbox.flush()
        if self.prefix:
            self.prefix.clear()

    def _iterate(self) -> None:
        self._drain(block=not self.active and not self.waiting)
        self._admit()
        if self.active:
            self._step()

    def _publish(self) -> None:
        """End of an iteration: refresh the engine figures for /metrics after any request ends (before its last
        event is delivered), else at most every STATS_EVERY_S while streams run (building them costs about a
        stream's own step overhead); then deliver every event of the iteration in one event-loop wake-up."""
        now = time.monotonic()
        if self._ended or not self.active or now - self._stats_at >= STATS_EVERY_S:
            self.engine_stats = {k: v for k, v in self.engine.stats.items() if not isinstance(v, dict)}
            self._stats_at, self._ended = now, False
        self.outbox.flush()

    def _step(self) -> None:
        items = self._plan()
        planned = [seq for seq, toks in items if seq.next_token is not None]
        items = self._make_room(items)
        stepped = {seq for seq, _ in items}
        for seq in planned:  # a decoding sequence left out waits its turn: it goes first next time
            seq.waited = 0 if seq in stepped else seq.waited + 1
        live = set(self.active)
        items = [(seq, toks) for seq, toks in items if seq in live]  # a failed choice ends its siblings
        if not items:
            return
        scoring = [_scores(seq) for seq, _ in items]
        acts = self.engine.activation_bytes(sum(len(toks) for _, toks in items), 0, _prompt_rows(items))
        held = self.engine.activation_bytes(0, self._logit_rows(items))
        with transient(self.engine.memory, held, "the step's logits"):  # while they are sampled (a chunk at a time)
            try:
                with transient(self.engine.memory, acts, "the step's activations"):
                    logits = self.engine.step([(seq.state, toks) for seq, toks in items], all_logits=any(scoring))
            except Exception as e:
                status = 507 if isinstance(e, BudgetError) else 500
                for seq, _ in items:
                    self._fail(seq, status, f"{type(e).__name__}: {e}")
                return
            self.counters["steps"] += 1
            self.counters["widest_step"] = max(self.counters["widest_step"], len(items))
            produced, lg = 0, None
            for at in range(0, len(items), LOGIT_CHUNK_ROWS):  # a chunk of a StepLogits at a time
                block = range(at, min(len(items), at + LOGIT_CHUNK_ROWS))
                if not any(scoring):
                    self._draw_ahead([items[i][0] for i in block], [logits[i] for i in block])
                for i in block:
                    (seq, toks), lg = items[i], logits[i]
                    seq.fed.extend(toks)
                    self.profile.learn(seq.state)
                    if any(scoring):  # every item got all its rows: score prompt chunks, keep the last row
                        if scoring[i]:
                            seq.prompt_entries += seq.scorer.feed(toks, lg)
                        lg = lg[-1]
                    if not seq.todo:
                        produced += self._sample_choices(seq, lg)
            self._drawn.clear()
            del logits, lg
        self._rate.append((time.monotonic(), produced))
        while self._rate and time.monotonic() - self._rate[0][0] > self.cfg.rate_window_s:
            self._rate.popleft()

    def _draw_ahead(self, seqs: list[_Seq], rows: list) -> None:
        """Sample the next token of each decoding sequence among `seqs` (one step's rows, in order) that samples
        without a grammar, sequences with the same temperature and top_p together (`sample_rows`: the tokens
        `_advance` would draw one by one, ~50 us of torch calls a row); `_advance` takes them from `_drawn`.
        At most SAMPLE_ROWS_BYTES of temporaries at once, charged while they exist."""
        groups: dict[tuple[float, float], list[tuple[_Seq, Any]]] = {}
        for seq, lg in zip(seqs, rows):
            if not seq.todo and seq.prefilled and seq.guide is None:
                req = seq.ticket.req
                groups.setdefault((req.temperature, req.top_p), []).append((seq, lg))
        for (temperature, top_p), got in groups.items():
            per = max(1, SAMPLE_ROWS_BYTES // (SAMPLE_ROW_COPIES * 4 * got[0][1].shape[-1]))
            for i in range(0, len(got), per):
                part = got[i:i + per]
                if len(part) < 2:
                    continue
                charge = SAMPLE_ROW_COPIES * 4 * part[0][1].shape[-1] * len(part)
                try:
                    with transient(self.engine.memory, charge, "batched sampling"):
                        toks = sample_rows(torch.stack([lg for _, lg in part]), SamplingParams(temperature, top_p),
                                           [seq.gen for seq, _ in part])
                except BudgetError:  # no room for the batch's temporaries: these rows sample one by one
                    continue
                self._drawn.update((seq, tok) for (seq, _), tok in zip(part, toks))
                self.counters["sampled_together"] += len(part)

    def _sample_choices(self, seq: _Seq, logits) -> int:
        """Sample the next token of `seq`, or, right after its prompt, of every choice forked from it."""
        try:
            choices = self._begin(seq) if not seq.prefilled else [seq]
        except Exception as e:  # no room to fork the choices, or a grammar that cannot start
            self._fail(seq, 507 if isinstance(e, BudgetError) else 500, f"{type(e).__name__}: {e}")
            return 0
        produced = 0
        for choice in choices:
            try:
                produced += self._advance(choice, logits)
            except Exception as e:  # one request's failure (sampling, decoding) must not end the others
                self._fail(choice, 500, f"internal error: {type(e).__name__}: {e}")
        return produced

    def _drain(self, block: bool) -> None:
        try:
            cmd = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                kind, arg = cmd
                if kind == "submit":
                    self.waiting.append(arg)
                elif kind == "cancel":
                    self._cancel(arg)
                cmd = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _cancel(self, ticket_id: int) -> None:
        """Drop a request and free its state now; its handler (if still waiting) gets a 499."""
        for ticket in list(self.waiting):
            if ticket.id == ticket_id:
                self.waiting.remove(ticket)
                self._dequeued()
                self.counters["cancelled"] += 1
                ticket.put(Failed(499, "the request was cancelled"))
        for seq in list(self.active):
            if seq.ticket.id == ticket_id:
                self.active.remove(seq)
                self._ended = True
                self.engine.free(seq.state)
                self.counters["cancelled"] += 1
                seq.ticket.put(Failed(499, "the request was cancelled"))

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.cfg.max_batch and self._fits(self.waiting[0].req):
            ticket = self.waiting.popleft()
            try:
                seq = self._start(ticket)
                seq.reserve = self._reserve(ticket.req)
                self.active.append(seq)
            except Exception as e:
                self.counters["failed"] += 1
                status = 507 if isinstance(e, BudgetError) else 400 if isinstance(e, RequestError) else 500
                ticket.put(Failed(status, f"{type(e).__name__}: {e}", err_type(status)))
            finally:
                self._dequeued()  # only now: `idle` never sees a request between the queue and the batch

    # ---- batch size from state ------------------------------------------------------------------------------
    def _reserve(self, req: GenRequest) -> int:
        n = len(req.prompt_ids)
        return self.profile.reserve(n, n + req.max_tokens, self.cfg.prefill_chunk)

    def state_room(self) -> int:
        """Budget bytes sequences' state may take: all but the fixed part and `expert_room`."""
        mem = self.engine.memory
        return mem.budget - mem.fixed() - self.expert_room

    def _fits(self, req: GenRequest) -> bool:
        """Admit while the state every running sequence may grow to, plus this one's, fits the state room: the batch
        never outgrows the budget as contexts lengthen. Until one sequence has shown its state's shape, one runs.
        A request that does not fit even alone is admitted alone (and fails with a clear 507)."""
        if not self.engine.memory.limited:
            return True
        if not self.active:
            return True
        if not self.profile.known:
            return False
        for seq in self.active:  # admitted before the profile was learned
            seq.reserve = seq.reserve or self._reserve(seq.ticket.req)
        return sum(s.reserve for s in self.active) + self._reserve(req) <= self.state_room()

    def plan_batch(self, prompt_len: int, max_tokens: int) -> dict:
        """How many sequences of this shape run at once, and why (None per sequence before the first step)."""
        per = self.profile.reserve(prompt_len, prompt_len + max_tokens, self.cfg.prefill_chunk) or None
        room = self.state_room() if self.engine.memory.limited else None
        fit = room // per if per and room is not None else None
        return {"max_batch": self.cfg.max_batch, "state_bytes_per_sequence": per, "state_room_bytes": room,
                "expert_room_bytes": self.expert_room, "state_fits_sequences": fit,
                "planned_max_batch": min(self.cfg.max_batch, fit) if fit is not None else self.cfg.max_batch}

    def _start(self, ticket: Ticket) -> _Seq:
        """Validate first, then allocate: whatever raises after the state exists frees it again."""
        req = ticket.req
        SamplingParams(req.temperature, req.top_p, 0, req.seed).validate()
        state, reused = None, 0
        if self.prefix is not None and not (req.echo and req.logprobs):  # scoring needs every prompt logit
            found = self._lookup(req.prompt_ids)
            if found is not None:
                state, reused = found
        if state is None:
            state = self.engine.new_sequence()
            state.account_host()
        try:
            seq = self._choice(ticket, state, 0)
        except BaseException:
            self.engine.free(state)
            raise
        self.observe("queue_wait", time.monotonic() - ticket.submitted)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        self.counters["prompt_tokens_reused"] += reused
        seq.todo, seq.fed, seq.reused = list(req.prompt_ids[reused:]), list(req.prompt_ids[:reused]), reused
        if req.echo and req.logprobs:
            seq.scorer = PromptScorer(self.tokenizer, req.top_logprobs)
        return seq

    def _choice(self, ticket: Ticket, state, index: int) -> _Seq:
        """Choice `index` of a request over `state`: its own sampler (seed + index), decoder, stops and grammar."""
        req = ticket.req
        seed = None if req.seed is None else req.seed if index == 0 else (req.seed + index) % 2**64
        params = SamplingParams(req.temperature, req.top_p, 0, seed).validate()
        text_tok = KeepingTokenizer(self.tokenizer, req.keep_token_ids) if req.keep_token_ids else self.tokenizer
        return _Seq(ticket, state, [], [], 0, StreamDecoder(text_tok, skip_special_tokens=True),
                    StopMatcher(req.stop), gen=params.generator() if req.temperature > 0 else None, index=index,
                    guide=self.guides.guide(req.grammar, req.logit_bias))

    def _begin(self, seq: _Seq) -> list[_Seq]:
        """The prompt is in: fork the other `n - 1` choices from its state (one shared prefill), send the echoed
        prompt, and return the choices that go on to sample (none when max_tokens is 0)."""
        seq.prefilled = True
        req = seq.ticket.req
        choices = [seq]
        for i in range(1, req.n):
            fork = self._choice(seq.ticket, None, i)
            fork.state, fork.fed, fork.reused, fork.prefilled = clone_state(seq.state), list(seq.fed), seq.reused, True
            self.active.append(fork)
            choices.append(fork)
        if req.echo:
            text = self.tokenizer.decode(req.prompt_ids)
            for c in choices:
                c.ticket.put(Delta(text, list(seq.prompt_entries), c.index))
        if req.max_tokens == 0:
            for c in choices:
                self._finish(c, "length")
            return []
        return choices

    def _lookup(self, tokens: list[int]):
        while True:
            try:
                return self.prefix.lookup(tokens)
            except BudgetError:
                if not self.prefix.evict_one():  # make room by dropping the least recently used prefix
                    return None
            except TypeError:  # this family's state cannot be cloned: serve without prefix reuse from now on
                self.prefix.clear()
                self.prefix = None
                return None

    def _plan(self) -> list[tuple[_Seq, list[int]]]:
        """Decoding sequences advance by one token; prefilling ones share `prefill_chunk` prompt tokens (FIFO)."""
        items, budget = [], max(1, self.cfg.prefill_chunk)
        fixed = getattr(self.engine.options, "batch_invariant", False)
        if fixed:
            return self._plan_fixed(items, budget)
        if self.engine.memory.limited and not self.profile.known:
            budget = 1  # one token shows the state's shape (admission waits for it); a whole prompt would read more
        prompts = []
        for seq in self.active:
            if not seq.todo:
                items.append((seq, [seq.next_token]))
            elif budget > 0:
                take = seq.todo[:budget]
                seq.todo = seq.todo[len(take):]
                budget -= len(take)
                prompts.append((seq, take))
        # decoding sequences first, those left out for room last time ahead of the rest, then the prompt chunks in
        # order: _make_room leaves out from the end, so no decoding sequence waits twice while others go on
        items.sort(key=lambda item: -item[0].waited)
        return items + prompts

    def _plan_fixed(self, items: list[tuple[_Seq, list[int]]], budget: int) -> list[tuple[_Seq, list[int]]]:
        """`_plan` for a batch-invariant engine: a prompt is cut where its own length says (every `prefill_chunk`
        tokens from its start), never where the step's budget ran out, so its attention and KV rows are the same
        whatever prompts share its steps. Prefilling sequences take their next whole piece while the step's budget
        holds it, in order (the first always fits); while the state's shape is unknown, one piece of one prompt."""
        chunk = budget
        one = self.engine.memory.limited and not self.profile.known
        for seq in self.active:
            if not seq.todo:
                items.append((seq, [seq.next_token]))
                continue
            take = seq.todo[:chunk - len(seq.fed) % chunk]
            if len(take) > budget:
                budget = 0  # first come, first served: no later prompt goes ahead of this one
                continue
            seq.todo = seq.todo[len(take):]
            budget = 0 if one else budget - len(take)
            items.append((seq, take))
        return items

    def _make_room(self, items: list[tuple[_Seq, list[int]]]) -> list[tuple[_Seq, list[int]]]:
        """Evict saved prefixes, then hold back the last items for a later step (prompt chunks, newest first, then
        the decoding sequences that went last time: `_plan`'s order; failing one only when it would not fit even
        alone), until the step's state growth, activations and what the step charges itself
        (`engine.step_charge`: batch invariance's buffers) fit the budget with the dense stream buffers and
        `expert_reserve` left free: a BudgetError inside `engine.step` would fail every sequence in it."""
        mem = self.engine.memory
        if not mem.limited:
            return items
        if not self.profile.known:  # growth unknown until one sequence has state: step one fresh at a time
            fresh = [i for i, (seq, _) in enumerate(items) if seq.state.pos == 0]
            for i in reversed(fresh[1:]):
                self._defer(*items.pop(i))
        growth = [self.profile.growth(seq.state, len(toks)) for seq, toks in items]  # each once: a step of
        grown, rows = sum(growth), sum(len(toks) for _, toks in items)  # 1,000 sequences may leave out hundreds
        prompt = _prompt_rows(items)
        while items:
            need = grown + self.engine.activation_bytes(rows, self._logit_rows(items), prompt) \
                + self.engine.step_charge(rows)
            room = mem.budget - mem.fixed() - mem.state_bytes - self.expert_reserve
            if need == 0 or need <= room:
                return items
            if self.prefix is not None and self.prefix.evict_one():
                continue
            seq, toks = items.pop()
            grown -= growth.pop()
            rows -= len(toks)
            prompt -= _prompt_rows([(seq, toks)])
            if items:
                self._defer(seq, toks)  # it runs once the older ones finish and free their state
                continue
            self._fail(seq, 507, f"the RAM budget has no room for this sequence's state ({need} bytes needed, "
                                 f"{room} free): raise --ram-budget, lower --max-batch or shorten the prompt")
        return items

    def _logit_rows(self, items: list[tuple[_Seq, list[int]]]) -> int:
        """Rows of logits the step of `items` holds at once (Engine.logit_rows; every row when it scores a prompt)."""
        return self.engine.logit_rows(len(items), any(_scores(seq) for seq, _ in items))

    @staticmethod
    def _defer(seq: _Seq, toks: list[int]) -> None:
        """Undo `_plan` for a sequence left out of this step (a decoding one keeps its next_token)."""
        if seq.next_token is None:  # still prefilling: the tokens go back in front of the rest of its prompt
            seq.todo = toks + seq.todo

    # ---- per-request output ---------------------------------------------------------------------------------
    def _advance(self, seq: _Seq, logits) -> int:
        """Sample the next token of `seq`, emit its text, and finish the request when it is done."""
        req = seq.ticket.req
        tok = self._drawn.pop(seq, None)
        if tok is None:
            shaped = seq.guide.apply(logits) if seq.guide is not None else logits
            tok = sample(shaped, SamplingParams(req.temperature, req.top_p, 0, req.seed), seq.gen)
        seq.generated += 1
        self.counters["tokens_generated"] += 1
        now = time.monotonic()
        if seq.generated == 1:
            self.observe("ttft", now - seq.ticket.submitted)
        else:
            self.observe("itl", now - seq.last_at)
        seq.last_at = now
        if req.logprobs:  # an end-of-sequence token gets its entry too (scorers count on one per generated token)
            seq.held.append(self._logprob(logits, tok, req.top_logprobs))
        if tok in self.eos:
            self._emit(seq, self._tail(seq))
            self._finish(seq, "stop")
            return 1
        if seq.guide is not None:
            seq.guide.accept(tok)
        text, hit = seq.matcher.feed(seq.decoder.push(tok))
        if hit:
            self._emit(seq, text)
            self._finish(seq, "stop")
        elif seq.guide is not None and seq.guide.done:  # the grammar is complete: nothing else may follow
            self._emit(seq, text + self._tail(seq))
            self._finish(seq, "stop")
        elif seq.generated >= req.max_tokens:
            self._emit(seq, text + self._tail(seq))
            self._finish(seq, "length")
        else:
            if text:
                self._emit(seq, text)
            seq.next_token = tok
        return 1

    @staticmethod
    def _tail(seq: _Seq) -> str:
        """Text still held back (incomplete UTF-8, a possible stop prefix) once no more tokens will come."""
        text, hit = seq.matcher.feed(seq.decoder.flush())
        return text if hit else text + seq.matcher.flush()

    def _logprob(self, logits, tok: int, top: int) -> TokenLogprob:
        lp = logits.float().log_softmax(-1)  # [V] from the raw fp32 logits: temperature and top_p not applied
        best, best_bytes = [], []
        if top > 0:
            vals, ids = lp.topk(top)
            best = [(self.tokenizer.decode([i]), v) for v, i in zip(vals.tolist(), ids.tolist())]
            best_bytes = [list(self.tokenizer.token_bytes(i)) for i in ids.tolist()]
        # bytes from the token itself: a token holding part of a UTF-8 character decodes to U+FFFD
        return TokenLogprob(self.tokenizer.decode([tok]), float(lp[tok]), best, list(self.tokenizer.token_bytes(tok)),
                            best_bytes)

    def _emit(self, seq: _Seq, text: str) -> None:
        if text or seq.held:
            seq.ticket.put(Delta(text, seq.held, seq.index))
            seq.held = []

    def _finish(self, seq: _Seq, reason: str) -> None:
        self._emit(seq, "")
        self.active.remove(seq)
        self._ended = True
        self.observe("duration", time.monotonic() - seq.ticket.submitted)
        seq.ticket.put(Done(reason, Usage(len(seq.ticket.req.prompt_ids), seq.generated, seq.reused), seq.index))
        if self.prefix is not None:
            self.prefix.save(seq.fed, seq.state)  # keeps it for a later request extending these tokens, or frees it
        else:
            self.engine.free(seq.state)

    def _fail(self, seq: _Seq, status: int, message: str) -> None:
        if seq in self.active:
            self.active.remove(seq)
        self._ended = True
        self.counters["failed"] += 1
        self.observe("duration", time.monotonic() - seq.ticket.submitted)
        try:
            self.engine.free(seq.state)
        finally:
            seq.ticket.put(Failed(status, message))
            for other in [s for s in self.active if s.ticket is seq.ticket]:  # its other choices end with it
                self.active.remove(other)
                self.engine.free(other.state)


def _prompt_rows(items: list[tuple[_Seq, list[int]]]) -> int:
    """Rows of a step's prompt chunks (items of more than one token), which hold more than a decoding row
    (Engine.activation_bytes)."""
    return sum(len(toks) for _, toks in items if len(toks) > 1)


def _scores(seq: _Seq) -> bool:
    """Whether the sequence's next step scores its prompt (all its rows' logits: echo with logprobs)."""
    return seq.scorer is not None and not seq.prefilled
