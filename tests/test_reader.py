"""Reader and store I/O: read plans (coalescing, alignment), O_DIRECT and buffered reads return the right bytes,
expert reads leave nothing in the OS page cache, buffers are recycled, and streaming with overlap and lookahead
computes exactly what an all-resident run computes."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import prompt_ids, save_reference
from moestream import Engine
from moestream.engine.engine import plan
from moestream.experts.reader import AHEAD, ALIGN, DEMAND, DIRECT_MIN, Reader, Span, file_resident_pages, plan_reads

VOCAB = 128


# ---- read plans ----------------------------------------------------------------------------------------------
def test_adjacent_spans_coalesce_into_one_aligned_run(tmp_path):
    f = tmp_path / "x"
    spans = [Span(f, 100_000 + 40_000, 40_000), Span(f, 100_000, 40_000), Span(f, 100_000 + 80_008, 40_000)]
    rp = plan_reads(spans)
    assert len(rp.runs) == 1  # the 8-byte hole is read through
    run = rp.runs[0]
    assert run.direct and run.start % ALIGN == 0 and run.length % ALIGN == 0 and run.dst == 0
    assert run.start <= 100_000 and run.start + run.length >= 100_000 + 120_008
    for s, start in zip(spans, rp.starts):  # every span lands where its file bytes do within the run
        assert start == s.offset - run.start


def test_far_apart_and_small_spans(tmp_path):
    f, g = tmp_path / "a", tmp_path / "b"
    spans = [Span(f, 0, 64 * 1024), Span(f, 10 << 20, 64 * 1024), Span(g, 5, 100)]
    rp = plan_reads(spans)
    assert len(rp.runs) == 3
    small = [r for r in rp.runs if not r.direct]
    assert len(small) == 1 and small[0].length == 100 and small[0].start == 5  # exact, not widened
    assert all(r.dst % ALIGN == 0 for r in rp.runs if r.direct)
    assert rp.nbytes < 2 * 64 * 1024 + 2 * ALIGN + 128


# ---- reads -----------------------------------------------------------------------------------------------------
@pytest.fixture
def data_file(tmp_path) -> tuple[Path, bytes]:
    data = os.urandom(3 * DIRECT_MIN + 12345)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages cannot be dropped; make them clean first
    os.close(fd)
    return path, data


@pytest.mark.parametrize("direct", [True, False])
def test_reads_return_file_bytes(data_file, direct):
    path, data = data_file
    spans = [Span(path, 777, 2 * DIRECT_MIN), Span(path, len(data) - 50, 50), Span(path, 3, 10)]
    rp = plan_reads(spans)
    reader = Reader(threads=2, direct=direct)
    try:
        buf = reader.submit(rp).result()
        for s, start in zip(spans, rp.starts):
            assert bytes(buf[start:start + s.nbytes]) == data[s.offset:s.offset + s.nbytes]
        assert reader.stats.bytes_read == rp.nbytes and reader.stats.requests == len(rp.runs)
    finally:
        reader.close()


def test_depth_bounds_reads_in_flight(data_file):
    """A scan raises the depth (more I/O threads, more reads in flight) and lowers it again; never more runs in
    flight than the depth, every read lands with the file's bytes."""
    path, data = data_file
    reader = Reader(threads=2)
    seen = []
    real = reader._read_run

    def counting(run, view):
        seen.append(reader._running)
        return real(run, view)

    reader._read_run = counting
    try:
        for depth in (4, 1, 2):
            reader.set_depth(depth)
            spans = [Span(path, i * 4096, DIRECT_MIN) for i in range(12)]
            futs = [reader.submit(plan_reads([s])) for s in spans]
            for s, f in zip(spans, futs):
                assert bytes(f.result()[:s.nbytes]) == data[s.offset:s.offset + s.nbytes]
            assert max(seen) <= depth
            seen.clear()
        assert len(reader._workers) == 4
    finally:
        reader.close()


@pytest.mark.parametrize("direct", [True, False])
def test_reads_do_not_fill_the_page_cache(data_file, direct):
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    before, total = file_resident_pages(path)
    if before > 0:
        pytest.skip("this filesystem keeps pages resident after POSIX_FADV_DONTNEED")
    reader = Reader(threads=2, direct=direct)
    try:
        reader.submit(plan_reads([Span(path, 0, len(data))])).result()
    finally:
        reader.close()
    after, _ = file_resident_pages(path)
    assert after == 0, f"{after} of {total} pages of the file stayed in the page cache"


def test_buffers_are_recycled():
    reader = Reader(threads=1)
    a = reader.pool.take(8192)
    reader.pool.give(a)
    assert reader.pool.idle_bytes == 8192
    assert reader.pool.take(8192) is a and reader.pool.idle_bytes == 0
    reader.pool.give(a)
    reader.pool.trim()
    assert reader.pool.idle_bytes == 0
    reader.close()


class _HeldReader(Reader):
    """A one-thread reader whose first read waits for `release`; records the file offset of every read started."""

    def __init__(self, threads: int = 1) -> None:
        super().__init__(threads=threads)
        self.release, self.started, self.order = threading.Event(), threading.Event(), []

    def _read_run(self, run, view):
        self.order.append(run.start)
        self.started.set()
        self.release.wait(10)
        return super()._read_run(run, view)


def _plan_at(path: Path, block: int):
    return plan_reads([Span(path, block * ALIGN, 2 * ALIGN)])


@pytest.fixture
def held(data_file):
    path, data = data_file
    reader = _HeldReader()
    first = reader.submit(_plan_at(path, 0))  # occupies the only I/O thread until released
    assert reader.started.wait(10)
    yield reader, path, data, first
    reader.release.set()
    reader.close()


def test_reads_a_step_waits_on_go_before_read_ahead(held):
    reader, path, data, first = held
    ahead = [reader.submit(_plan_at(path, b), AHEAD) for b in (2, 4)]
    demand = [reader.submit(_plan_at(path, b), DEMAND) for b in (6, 8)]
    reader.release.set()
    for f, b in zip(ahead + demand, (2, 4, 6, 8)):
        assert bytes(f.result(10)[:2 * ALIGN]) == data[b * ALIGN:(b + 2) * ALIGN]
    # demand first, each priority in submission order: experts land one after another, first queued first
    assert reader.order == [0, 6 * ALIGN, 8 * ALIGN, 2 * ALIGN, 4 * ALIGN]
    first.result(10)


def test_queued_read_ahead_is_cancelled_and_promoted(held):
    reader, path, data, first = held
    a, b, c = (reader.submit(_plan_at(path, blk), AHEAD) for blk in (2, 4, 6))
    idle = reader.pool.idle_bytes
    assert reader.cancel(b) and b.cancelled()
    assert reader.pool.idle_bytes == idle + _plan_at(path, 4).nbytes  # its buffer went back to the pool
    reader.promote(c)  # the step now waits on it: read before `a`
    assert not reader.cancel(first)  # started: it cannot be withdrawn
    reader.release.set()
    assert bytes(c.result(10)[:2 * ALIGN]) == data[6 * ALIGN:8 * ALIGN] and a.result(10) and first.result(10)
    assert reader.order == [0, 6 * ALIGN, 2 * ALIGN]  # the cancelled read never reached the disk
    assert not reader.cancel(a)  # finished
    assert reader.stats.requests == 3


def test_read_ahead_leaves_a_thread_free_for_what_a_step_waits_on(data_file):
    path, data = data_file
    reader = _HeldReader(threads=2)
    try:
        a, b = (reader.submit(_plan_at(path, blk), AHEAD) for blk in (0, 2))
        assert reader.started.wait(10)
        threading.Event().wait(0.1)  # the second thread is idle now: b may not take it
        c = reader.submit(_plan_at(path, 4), DEMAND)  # starts at once on the second thread, not after b
        for _ in range(1000):
            if len(reader.order) == 2:
                break
            threading.Event().wait(0.01)
        assert reader.order == [0, 4 * ALIGN]
        reader.release.set()
        for f, blk in ((a, 0), (b, 2), (c, 4)):
            assert bytes(f.result(10)[:2 * ALIGN]) == data[blk * ALIGN:(blk + 2) * ALIGN]
        assert reader.order == [0, 4 * ALIGN, 2 * ALIGN]
    finally:
        reader.release.set()
        reader.close()


class _LateReturnCondition(threading.Condition):
    """The reader's queue lock, except that the submitting thread, once armed, stalls right after releasing it
    until the read has completed: the scheduling a busy machine produces now and then, made certain."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.submitter, self.completed = None, threading.Event()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if threading.current_thread() is self.submitter:
            self.submitter = None
            assert self.completed.wait(10)
        return out


def test_submit_returns_the_future_even_when_the_read_finishes_first(data_file):
    """A read completed (and its job detached) before submit returned used to hand back None instead of the
    future; the expert dispatcher then failed with AttributeError (found by bench/fuzz_checkpoints.py)."""
    path, data = data_file
    reader = Reader(threads=1, direct=False)
    cv = reader._cv = _LateReturnCondition()
    try:
        cv.submitter = threading.current_thread()
        fut = reader.submit(_plan_at(path, 1), then=lambda buf: (cv.completed.set(), buf)[1])
        assert fut is not None and bytes(fut.result(10)[:2 * ALIGN]) == data[ALIGN:3 * ALIGN]
    finally:
        reader.close()


def test_a_failed_read_fails_its_future_and_returns_the_buffer(tmp_path):
    reader = Reader(threads=1, direct=False)
    try:
        fut = reader.submit(plan_reads([Span(tmp_path / "missing.bin", 0, 100)]))
        with pytest.raises(Exception, match="missing.bin"):
            fut.result(10)
        assert reader.pool.idle_bytes > 0
    finally:
        reader.close()


# ---- the store on a real checkpoint --------------------------------------------------------------------------
def _qwen_config(**kw):
    from transformers import Qwen3MoeConfig

    base = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, intermediate_size=128, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                norm_topk_prob=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(kw)
    return Qwen3MoeConfig(**base)


@pytest.fixture(scope="module")
def hub_ckpt(tmp_path_factory):
    """A tiny qwen3_moe in the Hub layout (one bf16 tensor per expert part, so an expert is 3 adjacent tensors)."""
    from transformers import Qwen3MoeForCausalLM

    src = tmp_path_factory.mktemp("qwen_src")
    model = save_reference(Qwen3MoeForCausalLM, _qwen_config(), src)
    out = tmp_path_factory.mktemp("qwen_hub")
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                tensors[f"{base}{e}.gate_proj.weight"] = gate.to(torch.bfloat16).contiguous()
                tensors[f"{base}{e}.up_proj.weight"] = up.to(torch.bfloat16).contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                tensors[f"{base}{e}.down_proj.weight"] = t[e].to(torch.bfloat16).contiguous()
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    return out, tensors


def test_store_reads_each_expert_with_one_request(hub_ckpt):
    path, tensors = hub_ckpt
    store = plan(path).store
    try:
        blobs = store.read_many([(0, 3), (2, 15)])
        for (layer, e), blob in zip([(0, 3), (2, 15)], blobs):
            got = blob.tensors()
            for part in ("gate", "up", "down"):
                want = tensors[f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"]
                assert torch.equal(got[part], want)
        assert store.reader.stats.requests == 2  # gate, up and down of an expert are adjacent: one read
    finally:
        store.close()


def test_a_recycled_buffer_keeps_its_views_for_the_next_expert_of_its_layout(hub_ckpt):
    """An evicted expert's part views go back to the pool with its buffer; the next expert of the same layout read
    into that buffer uses them again (no new views), and they hold that expert's values."""
    path, tensors = hub_ckpt
    store = plan(path).store
    try:
        keys = [(layer, e) for layer in range(3) for e in range(16)]
        for k in keys:
            store.read_plan(*k)
        # parts sit at the file's offsets modulo the 4 KiB read alignment: experts whose parts share them share a layout
        same = [k for k in keys[1:] if store._layouts[k] is store._layouts[keys[0]]
                and store.resident_nbytes(*k) == store.resident_nbytes(*keys[0])]
        other = [k for k in keys[1:] if store._layouts[k] is not store._layouts[keys[0]]
                 and store.resident_nbytes(*k) == store.resident_nbytes(*keys[0])]
        assert same and other
        first = store.read(*keys[0])
        views = first.tensors()
        store.recycle(first)
        assert store.reader.pool.idle_bytes == first.nbytes
        layer, e = same[-1]
        second = store.read(layer, e)
        assert second.buf is first.buf  # the recycled buffer
        got = second.tensors()
        assert got is views
        for part in ("gate", "up", "down"):
            assert torch.equal(got[part], tensors[f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"])
        store.recycle(second)
        layer, e = other[0]
        third = store.read(layer, e)  # the same buffer, another layout: views of its own
        assert third.buf is first.buf and third.tensors() is not views
        for part in ("gate", "up", "down"):
            assert torch.equal(third.tensors()[part], tensors[f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"])
        second = third
        assert store.reader.pool.claim(second.buf) is None  # handed on once
        store.recycle(second)
        store.reader.pool.trim(0)  # dropped with their buffer
        assert store.reader.pool.idle_bytes == 0 and not store.reader.pool._kept
    finally:
        store.close()


def _greedy(path, budget, n=12, lookahead=False, **opts):
    eng = Engine.open(path, ram_budget=budget, **opts)
    eng.runner.lookahead.enabled = lookahead
    try:
        ids = prompt_ids(VOCAB, 20)
        logits = eng.logits(ids)
        out = eng.generate(ids, n, stop_token_ids=[])
        return logits, out, eng.stats, eng
    finally:
        eng.close()


def test_streaming_with_overlap_and_lookahead_matches_resident(hub_ckpt):
    path, _ = hub_ckpt
    p = plan(path)
    budget = p.dense_bytes + p.scratch_bytes + p.expert_bytes // 4
    full_logits, full_out, _, _ = _greedy(path, None)
    logits, out, stats, eng = _greedy(path, budget, lookahead=True)
    # same fp32 computation; only the order in which experts add into the output differs (hits, then arrivals)
    assert (logits - full_logits).abs().max() <= 1e-5 * full_logits.abs().max()
    assert out == full_out
    assert stats["expert_evictions"] > 0 and stats["peak_resident_bytes"] <= budget
    assert eng.runner.lookahead.gates, "qwen3_moe registers its routers, so the lookahead must be scored"
    assert eng.runner.times.steps > 0


def test_tiny_budget_reads_in_waves(hub_ckpt):
    """Room for only a couple of experts: misses are read as room frees, still the same result."""
    path, _ = hub_ckpt
    p = plan(path)
    kv = 3 * 2 * 256 * 2 * 32 * 4  # layers * (k, v) * rows grown at once * kv heads * head dim * fp32
    budget = p.dense_bytes + p.scratch_bytes + kv + 2 * p.store.resident_nbytes(0, 0) + 1000
    full_logits, full_out, _, _ = _greedy(path, None, n=4)
    logits, out, stats, _ = _greedy(path, budget, n=4)
    assert (logits - full_logits).abs().max() <= 1e-5 * full_logits.abs().max()
    assert out == full_out and stats["peak_resident_bytes"] <= budget


def test_read_ahead_is_withdrawn_or_promoted_when_the_layer_routes(hub_ckpt):
    """The lookahead queued experts 5 and 6 of layer 1 behind a read that holds the only I/O thread; layer 1 then
    routes to 5 (and 7), not 6: 6 is cancelled before it reaches the disk and its room returns to the cache, 5 is
    awaited like any miss, and the step's result is what the experts compute."""
    path, tensors = hub_ckpt
    eng = Engine.open(path, io_threads=1)
    try:
        store, runner = eng.plan.store, eng.runner
        gate = threading.Event()
        hold = store.reader.submit(store.read_plan(2, 0)[0], then=lambda buf: (gate.wait(10), buf)[1])
        for e in (5, 6):
            nbytes = store.resident_nbytes(1, e)
            assert runner.cache.reserve(nbytes)
            runner._inflight[(1, e)] = (store.submit(1, e, AHEAD), nbytes)
        reserved = runner.cache.reserved_bytes
        withdraw = runner._withdraw
        runner._withdraw = lambda *a: (withdraw(*a), gate.set())  # the I/O thread is freed only after it ran
        x = torch.randn(1, 128)
        out = runner.run(1, x, torch.tensor([[5, 7]]), torch.tensor([[0.75, 0.25]]),
                         lambda xs, t: xs @ t["gate"].float().t(), out_dim=64)  # any function of the expert's bytes
        hold.result(10)
        assert runner.times.prefetch_withdrawn == 1 and runner.times.prefetch_joined == 1
        assert (1, 6) not in runner._inflight and (1, 6) not in runner.cache
        assert runner.cache.reserved_bytes == reserved - 2 * store.resident_nbytes(1, 5)  # 6 released, 5 landed
        want = sum(w * (x @ tensors[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].float().t())
                   for e, w in ((5, 0.75), (7, 0.25)))
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)
    finally:
        eng.close()


def test_state_growth_gives_back_the_buffers_of_the_experts_it_evicts(tmp_path_factory):
    """Experts evicted to make room for state (or scratch, or measured unbooked memory) leave their buffers idle in
    the pool; beyond the cache's free room those lie outside the budget, so they go back at once, not at the end of
    the next MoE layer."""
    from conftest import expert_budget, synth_tiny
    from moestream import Engine

    tiny = synth_tiny(tmp_path_factory, "qwen3_moe")
    eng = Engine.open(tiny, ram_budget=expert_budget(tiny, 1.0))
    try:
        st = eng.new_sequence()
        eng.step([(st, list(range(1, 40)))])
        cache, pool = eng.memory.cache, eng.plan.store.reader.pool
        held = cache.resident_bytes
        assert held > 0
        grow = cache.free() + held // 2  # evicts about half the cached experts
        eng.memory.grow_state(grow, "test state")
        assert cache.resident_bytes <= held - held // 2
        assert pool.idle_bytes <= max(0, cache.free())
        eng.memory.release_state(grow)
    finally:
        eng.close()
