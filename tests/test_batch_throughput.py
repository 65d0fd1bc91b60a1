"""The large-batch path: many sequences per step equal each alone, batched decode attention equals the per-sequence
one, and the scheduler sizes the batch from the state the budget can hold (never a BudgetError, never over it)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from moestream import Engine
from moestream.engine.engine import plan
from moestream.memory.accountant import MemoryAccountant
from moestream.models.attention import KVSlot, cached_attention, decode_attention
from moestream.memory.state import Segment, SeqState, host_bytes_of
from moestream.server.prefix import buffers, rows_at
from moestream.server.protocol import GenRequest
from moestream.server.scheduler import Scheduler, SchedulerConfig
from moestream.server.tickets import Done, Failed
from moestream.synth import synthesize
from moestream.tokenizer import Tokenizer

from conftest import expert_budget, max_rel_diff, prompt_ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch") / "q3"
    synthesize("qwen3_moe", path, "tiny", progress=False)
    return path


def _greedy_batched(eng: Engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
    """All prompts prefilled in one step, then decoded together one token per sequence per step. Returns the
    tokens and the state bytes the sequences held at the end."""
    states = [eng.new_sequence() for _ in prompts]
    logits = eng.step(list(zip(states, prompts)))
    out = [[] for _ in prompts]
    for i in range(n):
        toks = [int(lg.argmax()) for lg in logits]
        for o, t in zip(out, toks):
            o.append(t)
        if i + 1 < n:
            logits = eng.step([(s, [t]) for s, t in zip(states, toks)])
    held = eng.memory.state_bytes
    for s in states:
        eng.free(s)
    return out, held


def test_many_sequences_batched_equal_each_alone_under_evictions(tiny):
    prompts = [prompt_ids(512, 3 + (i * 7) % 29, seed=i) for i in range(40)]
    want, state = _greedy_batched(Engine.open(tiny), prompts, 12)
    budget = expert_budget(tiny, 0.3) + state  # a third of the experts beside the 40 sequences' KV
    eng = Engine.open(tiny, ram_budget=budget)
    got, _ = _greedy_batched(eng, prompts, 12)
    assert got == want
    s = eng.stats
    assert s["expert_evictions"] > 0 and s["peak_resident_bytes"] <= budget
    # every step routes to all experts (a scan): the resident set survives it (recency order alone gave 0 hits)
    assert s["expert_hit_rate"] > 0.15
    alone = Engine.open(tiny, ram_budget=budget)
    for p, g in zip(prompts, got):
        assert alone.generate(p, 12, stop_token_ids=[]) == g


@pytest.mark.parametrize("window,sinks", [(None, False), (5, False), (None, True)])
def test_decode_attention_equals_per_sequence(window, sinks):
    torch.manual_seed(0)
    mem, hq, hkv, d = MemoryAccountant(None), 4, 2, 8
    lens = [1, 3, 9, 2, 17]
    sink = torch.randn(hq) if sinks else None
    a = [KVSlot(mem, hkv, d, d) for _ in lens]
    b = [KVSlot(mem, hkv, d, d) for _ in lens]
    for sa, sb, n in zip(a, b, lens):  # the same history in both copies
        k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        sa.k.append(k), sa.v.append(v), sb.k.append(k), sb.v.append(v)
    q, k, v = torch.randn(len(lens), hq, d), torch.randn(len(lens), hkv, d), torch.randn(len(lens), hkv, d)
    got = decode_attention(a, q, k, v, 0.3, window, sink)
    for i, n in enumerate(lens):
        seg = Segment(SeqState(mem, 1), i, 1, n)
        want = cached_attention(seg, b[i], q[i:i + 1], k[i:i + 1], v[i:i + 1], 0.3, window, sink)
        assert max_rel_diff(got[i:i + 1], want) < 1e-6


def test_peak_blocks_replays_block_buffer():
    """The admission profile's replay of KV blocks equals what a BlockBuffer charges at its peak, with and without
    a sliding window."""
    from moestream.memory.state import BlockBuffer
    from moestream.server.prefix import peak_blocks

    for prompt, context, chunk in ((64, 128, 2048), (64, 128, 16), (300, 1000, 64), (5, 5, 1), (1, 600, 256),
                                   (700, 900, 256)):
        for window in (None, 1, 20, 64, 100, 4096):
            mem = MemoryAccountant(None)
            buf, fed, peak = BlockBuffer(mem, (1,), window=window), 0, 0
            while fed < context:
                n = min(chunk, prompt - fed) if fed < prompt else 1
                buf.push(torch.zeros(n, 1))
                peak = max(peak, mem.state_bytes)
                fed += n
            assert peak_blocks(prompt, context, chunk, window) * buf.block_charge == peak, (prompt, context, chunk, window)
        assert rows_at(prompt, context, chunk) == -(-max(context, min(prompt, context)) // 64) * 64


def _run_job(eng: Engine, tok: Tokenizer, reqs: list[GenRequest], cfg: SchedulerConfig):
    sched = Scheduler(eng, tok, cfg).start()
    widths: list[int] = []
    inner = eng.step

    def step(items, all_logits=False):  # records how many sequences each step advances
        widths.append(len(items))
        return inner(items, all_logits)

    eng.step = step

    async def one(r):
        t, text = sched.submit(r), []
        while True:
            ev = await t.next()
            if isinstance(ev, (Done, Failed)):
                ev.text = "".join(text)
                return ev
            text.append(ev.text)

    async def job():
        return await asyncio.gather(*(one(r) for r in reqs))

    try:
        return asyncio.run(job()), widths, sched
    finally:
        sched.stop()
        eng.step = inner


def test_admission_bounded_by_state_room(tiny):
    """A budget whose state room holds a few sequences: the job runs them a few at a time, all finish, the budget
    is never exceeded, and the plan says how many fit."""
    p = plan(tiny)
    eng_probe = Engine.open(tiny)
    st = eng_probe.new_sequence()
    eng_probe.step([(st, [3] * 20)])
    # 20 + 50 tokens: two 64-row blocks a buffer reserved whole, and the bookkeeping a scheduler books for each
    # sequence
    per_seq = 2 * sum(b.block_charge for b in buffers(st)) + host_bytes_of(st.num_layers)
    eng_probe.free(st)
    cfg = SchedulerConfig(max_batch=64, max_queue=100, prefill_chunk=64, expert_room=4 * p.max_expert_bytes)
    budget = p.dense_bytes + p.scratch_bytes + cfg.expert_room + 5 * per_seq + per_seq // 2
    eng = Engine.open(tiny, ram_budget=budget)
    tok = Tokenizer.load(tiny)
    reqs = [GenRequest(prompt_ids(512, 20, seed=i), 50, 0.0) for i in range(24)]
    events, widths, sched = _run_job(eng, tok, reqs, cfg)
    assert all(isinstance(e, Done) for e in events), [e for e in events if isinstance(e, Failed)][:2]
    planned = sched.plan_batch(20, 50)
    assert planned["state_bytes_per_sequence"] == per_seq and planned["planned_max_batch"] == 5
    assert max(widths) == 5 and eng.stats["peak_resident_bytes"] <= budget
    assert eng.stats["expert_evictions"] > 0


def test_greedy_job_equals_each_request_alone(tiny):
    eng = Engine.open(tiny, ram_budget=expert_budget(tiny, 0.3) + 64 * (1 << 20))
    reqs = [GenRequest(prompt_ids(512, 5 + i, seed=i), 6, 0.0) for i in range(12)]
    cfg = SchedulerConfig(max_batch=12, max_queue=20, prefill_chunk=40)
    tok = Tokenizer.load(tiny)
    events, widths, _ = _run_job(eng, tok, reqs, cfg)
    assert max(widths) > 4  # requests really ran together
    alone = Engine.open(tiny)
    for r, ev in zip(reqs, events):
        want = alone.generate(r.prompt_ids, 6, stop_token_ids=sorted(set(tok.eos_token_ids) | set(alone.eos_token_ids)))
        assert isinstance(ev, Done) and ev.usage.completion_tokens == len(want)
        assert ev.text == tok.decode(want, skip_special_tokens=True)


def test_a_large_step_charges_its_activations(tiny):
    """A batch step of many rows (a prefill chunk across prompts) holds activations and logits beyond the fixed
    scratch: the scheduler charges them around the step (the expert cache makes room), and releases them after."""
    from moestream.engine.engine import ACT_FREE_ROWS

    eng = Engine.open(tiny, ram_budget=expert_budget(tiny, 0.3) + (8 << 20))
    assert eng.plan.activation_row_bytes > 0
    seen = []
    real = eng.model.forward

    def spy(tokens, batch, rows, head=True):
        seen.append((tokens.shape[0], len(batch.segments), eng.memory.state_bytes, eng.memory.peak))
        return real(tokens, batch, rows, head)

    eng.model.forward = spy
    reqs = [GenRequest(prompt_ids(512, 30, seed=i), 2, 0.0) for i in range(6)]
    cfg = SchedulerConfig(max_batch=8, max_queue=10, prefill_chunk=180)
    events, _, _ = _run_job(eng, Tokenizer.load(tiny), reqs, cfg)
    assert all(isinstance(e, Done) for e in events)
    rows, segs, charged, _ = max(seen)  # the widest step: rows beyond ACT_FREE_ROWS are charged while it runs
    assert rows > ACT_FREE_ROWS and charged >= eng.activation_bytes(rows, segs, rows) > 0  # prompt rows, all
    assert eng.activation_bytes(rows, segs, rows) > eng.activation_bytes(rows, segs)  # a prompt row holds more
    assert eng.memory.state_bytes == 0 and eng.stats["peak_resident_bytes"] <= eng.memory.budget


def test_scan_window_covers_a_layers_misses_within_a_quarter_of_the_cache():
    from moestream.experts.dispatch import scan_window

    mib = 1 << 20
    peer = dict(expert=3 * mib, experts=64, top_k=8, layers=32)  # a 6 GiB checkpoint, 192 MiB a layer
    w = scan_window(capacity=1400 * mib, **peer)
    layer_misses = 192 * mib * (1 - 1400 / (192 * 32))
    assert w == int(1.5 * layer_misses) and w > 2 * 8 * 3 * mib  # more than the old 2 x top_k experts
    assert scan_window(capacity=400 * mib, **peer) == 100 * mib  # a small cache keeps 3/4 of itself resident
    assert scan_window(capacity=100 * mib, **peer) == 2 * 8 * 3 * mib  # never below 2 x top_k experts
    assert scan_window(capacity=7000 * mib, **peer) == 2 * 8 * 3 * mib  # all resident: nothing to read ahead


def _bench_module():
    """bench/batch_throughput.py, imported as a module."""
    import importlib
    import sys

    bench = Path(__file__).resolve().parent.parent / "bench"
    sys.path.insert(0, str(bench))
    try:
        return importlib.import_module("batch_throughput")
    finally:
        sys.path.remove(str(bench))


def test_bench_runs_the_job_as_moestream_batch_does(tiny):
    """bench/batch_throughput.py's default runner sends the requests through `moestream batch`'s job (input file,
    fsynced output file): sampled at temperature 1 with each request's seed, every text equals the one the
    server's Scheduler gives the same request, and the report says how wide the steps were."""
    bt = _bench_module()
    eng = Engine.open(tiny, ram_budget=expert_budget(tiny, 0.3) + 64 * (1 << 20))
    try:
        tok = Tokenizer.load(tiny)
        reqs = bt.job_requests(eng.vocab_size, 6, 9, 5, 1.0, 7)
        meter = bt.StepMeter(eng)
        direct, _ = bt.run_scheduler(eng, tok, reqs, 4, 64)
        meter.close()
        via_job, rep = bt.run_as_job(eng, tok, reqs, 4, 64)
    finally:
        eng.close()
    detail = [s.detail() for s in meter.steps]  # each step's page faults and kernel CPU, the process's
    assert len(detail) >= 5 and all(d["minor_faults"] >= 0 and d["system_s"] >= 0 for d in detail)
    assert sum(d["minor_faults"] for d in detail) > 0
    assert detail[0]["gap_s"] == 0 and all(d["gap_s"] > 0 for d in detail[1:])  # the scheduler's time between steps
    assert [r["text"] for r in via_job] == [r["text"] for r in direct]
    assert [r["tokens"] for r in via_job] == [5] * 6
    assert 0 < rep["widest_step"] <= 4 and rep["steps"] >= 5 and rep["failed"] == 0
    assert rep["batch_plan"]["state_bytes_per_sequence"] > 0


def test_rows_sampled_together_draw_each_requests_own_tokens(tiny):
    """A step's decoding rows with the same temperature and top_p are sampled in one set of torch calls
    (Scheduler._draw_ahead): each request's text is the one it gets alone (one row a step, sampled by itself), at
    several temperatures and top_p, greedy included."""
    bt = _bench_module()
    eng = Engine.open(tiny)
    try:
        tok = Tokenizer.load(tiny)
        reqs = bt.job_requests(eng.vocab_size, 12, 5, 7, 1.0, 3)
        for i, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)] * 4):
            reqs[i].temperature, reqs[i].top_p = t, p
        together, rep = bt.run_scheduler(eng, tok, reqs, 12, 64)
        alone, rep_alone = bt.run_scheduler(eng, tok, reqs, 1, 64)
    finally:
        eng.close()
    assert [r["text"] for r in together] == [r["text"] for r in alone]
    assert [r["tokens"] for r in together] == [7] * 12
    assert len({r["text"] for r in together[:12:3]}) > 1  # the sampled texts differ from one another
    assert rep["sampled_together"] >= 12 * 5 and rep_alone["sampled_together"] == 0


def test_decoding_sequences_left_out_for_room_go_first_next_step(tiny):
    """A step the budget cannot hold whole leaves out its last items (_make_room): decoding sequences come first,
    those left out last time ahead of the others, and prompt chunks after them, so none waits twice in a row."""
    eng = Engine.open(tiny)
    try:
        _left_out_go_first(Scheduler(eng, Tokenizer.load(tiny), SchedulerConfig(max_batch=8, prefill_chunk=16)))
    finally:
        eng.close()


def _left_out_go_first(sched) -> None:
    from moestream.server.scheduler import _Seq

    def seq(name, todo, next_token=None, waited=0):
        return _Seq(None, name, list(todo), [], 0, None, None, next_token=next_token, waited=waited)

    a, b, c, p = seq("a", [], 5), seq("b", [], 6), seq("c", [], 7, waited=1), seq("p", range(10))
    sched.active = [p, a, b, c]
    items = sched._plan()
    assert [s for s, _ in items] == [c, a, b, p] and items[-1][1] == list(range(10))
    left = []
    sched._make_room = lambda items: items[:-2]  # room for two of the four
    sched._plan = lambda: [(c, [7]), (a, [5]), (b, [6]), (p, [0])]
    sched.engine.step = lambda items, all_logits=False: left.extend(st for st, _ in items) or [None] * len(items)
    sched._sample_choices = lambda seq, logits: 0
    sched.profile.learn = lambda state: None
    sched._step()
    assert left == ["c", "a"] and (a.waited, b.waited, c.waited) == (0, 1, 0)


@pytest.mark.parametrize("kv", ["int4", "fp32", "bf16"])
@pytest.mark.parametrize("lengths, groups, adjacent", [([20, 20, 24, 20, 20, 24], [4, 2], 0),
                                                        ([20, 20, 20, 24, 24], [3, 2], 2)])
def test_same_length_prompts_attend_in_one_call_bit_for_bit(tiny, monkeypatch, kv, lengths, groups, adjacent):
    """A step's whole prompts of one length attend in one flash call (attention.fresh_attention_many), beside
    decoding sequences that take the paged call (their rows lead the step: the prompts' q/k norm and rope run on
    the rows after them alone). Every row's logits equal those of the same step with one call per prompt, bit for
    bit, and the flash call takes the prompts of each length together. Prompts of a group in consecutive rows are
    passed as views of the step's q (and k, v where the cache stores them as computed: fp32, or int4 decoded
    once for the step), not stacked copies."""
    from moestream.models import attention

    def step(group_bytes: int) -> tuple[list[torch.Tensor], list[int], list[bool]]:
        monkeypatch.setattr(attention, "FRESH_GROUP_BYTES", group_bytes)
        eng = Engine.open(tiny, kv_dtype=kv)
        old = [eng.new_sequence() for _ in range(3)]
        eng.step([(s, prompt_ids(512, 20, seed=i)) for i, s in enumerate(old)])
        calls, viewed = [], []
        real, real_adjacent = attention.fresh_attention_many, attention.adjacent
        monkeypatch.setattr(attention, "fresh_attention_many", lambda slot, q, *a: calls.append(q.shape[0]) or
                            real(slot, q, *a))
        monkeypatch.setattr(attention, "adjacent", lambda parts: viewed.append(real_adjacent(parts) is not None)
                            or real_adjacent(parts))
        items = [(s, [5 + i]) for i, s in enumerate(old)] + \
                [(eng.new_sequence(), prompt_ids(512, n, seed=10 + i)) for i, n in enumerate(lengths)]
        got = [lg.clone() for lg in eng.step(items, all_logits=True)]
        monkeypatch.setattr(attention, "fresh_attention_many", real)
        monkeypatch.setattr(attention, "adjacent", real_adjacent)
        return got, calls, viewed

    grouped, calls, viewed = step(attention.FRESH_GROUP_BYTES)
    alone, calls_alone, _ = step(1)
    layers = len(calls_alone) // len(lengths)
    assert calls == groups * layers and calls_alone == [1] * len(lengths) * layers
    assert all(torch.equal(a, b) for a, b in zip(grouped, alone))
    per_layer = [sum(viewed[i:i + 6]) for i in range(0, len(viewed), 6)]  # q, k, v of each of the two groups
    assert per_layer == [adjacent * (1 if kv == "bf16" else 3)] * layers  # a bf16 cache's k, v: rounded copies


def test_short_prompts_beside_others_take_the_batched_path(tiny, monkeypatch):
    """Prompts of a few tokens sharing a step (with each other or with decoding sequences) attend on the general
    path: the decoding rows in one paged call a layer, never the per-sequence native call that gathers each whole
    cache; one sequence alone still takes the native call. Greedy tokens equal each request alone."""
    from moestream.models import attention

    native, paged = [], []
    real_native, real_paged = attention.GQAMixer._native_call, attention.GQAMixer._attend_paged
    monkeypatch.setattr(attention.GQAMixer, "_native_call", lambda self, *a: native.append(1) or real_native(self, *a))
    monkeypatch.setattr(attention.GQAMixer, "_attend_paged", lambda self, *a: paged.append(1) or real_paged(self, *a))
    eng = Engine.open(tiny, kv_dtype="int8")
    layers = len(eng.model.layers)
    old = [eng.new_sequence() for _ in range(3)]
    eng.step([(s, prompt_ids(512, 6, seed=i)) for i, s in enumerate(old)])
    assert native == [] and paged == []
    eng.step([(s, [5 + i]) for i, s in enumerate(old)] + [(eng.new_sequence(), prompt_ids(512, 5, seed=9))])
    assert native == [] and len(paged) == layers
    eng.step([(eng.new_sequence(), prompt_ids(512, 5, seed=10))])
    assert len(native) == layers
    prompts = [prompt_ids(512, 3 + i % 9, seed=20 + i) for i in range(12)]
    want = [_greedy_batched(Engine.open(tiny, kv_dtype="int8"), [p], 6)[0][0] for p in prompts]
    assert _greedy_batched(Engine.open(tiny, kv_dtype="int8"), prompts, 6)[0] == want
