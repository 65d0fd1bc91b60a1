"""The one-call decode layer (fused.DecodeBlock / ms_gqa_decode_block, GQAMixer.decode_block, Layer._decode): the
same values bit for bit as the separate native calls it replaces (norms, q/k/v, attention with the KV append,
o_proj, residual, router), across KV blocks and with 1 and 2 threads; a sliding window against the torch path;
the warm one-token step actually takes it (counters); bad operands get clear errors; the pool's counters."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import expert_budget, gqa_block_weights, max_rel_diff, prompt_ids
from moestream import Engine
from moestream.kernels import cpu, fused
from moestream.memory.state import BLOCK_TOKENS, Batch
from moestream.models.attention import GQAMixer
from moestream.models.base import DecoderModel
from moestream.models.blocks import rms_norm
from moestream.synth import synthesize

native = pytest.mark.skipif(not cpu.available(), reason=f"no native kernels here ({cpu.reason()})")


@pytest.fixture
def threads():
    before = cpu.threads()
    yield cpu.set_threads
    cpu.set_threads(before)


def _decode(eng: Engine, ids: list[int], fast: bool | str, monkeypatch) -> torch.Tensor:
    """Logits of a fresh sequence fed one token per step: `fast` True takes the native paths the engine takes (all
    layers in native runs, DecoderModel.decode_layers), "block" one native call a layer (Layer._decode), False the
    separate calls."""
    with monkeypatch.context() as m:
        if fast is not True:
            m.setattr(DecoderModel, "decode_layers", lambda *a, **k: None)
        if not fast:
            m.setattr(GQAMixer, "decode_block", lambda *a, **k: None)
        state = eng.new_sequence()
        try:
            return torch.stack([eng.step([(state, [t])])[0] for t in ids])
        finally:
            eng.free(state)


@native
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_decode_block_equals_separate_calls_and_is_taken(family, n_threads, tmp_path, monkeypatch, threads):
    """Warm (every expert cached, so both paths take the grouped kernel): identical logits over more than one KV
    block, and every layer of every step went through the decode block and the resident expert step."""
    synthesize(family, tmp_path / family, "tiny", progress=False)
    eng = Engine.open(tmp_path / family, ram_budget="1GB")
    eng.runner.lookahead.reads = 0  # no read ahead: whether one is still in flight would depend on thread timing
    threads(n_threads)
    ids = prompt_ids(eng.vocab_size, BLOCK_TOKENS + 6, seed=5)
    _decode(eng, ids, True, monkeypatch)  # warm the expert cache
    _decode(eng, ids, False, monkeypatch)
    layers = eng.model.layers
    blocks0, resident0 = sum(ly.mixer.decode_blocks for ly in layers), eng.runner.times.resident_steps
    fused0 = _fused_steps(eng)
    got = _decode(eng, ids, "block", monkeypatch)
    assert sum(ly.mixer.decode_blocks for ly in layers) - blocks0 == len(layers) * len(ids)
    assert eng.runner.times.resident_steps - resident0 == len(layers) * len(ids)
    # ... and the routed experts in the same native call (the runner's tables held every routed expert)
    assert _fused_steps(eng) - fused0 == len(layers) * len(ids)
    want = _decode(eng, ids, False, monkeypatch)
    assert torch.equal(got, want)
    # every layer of a step in one native call: the same logits, every layer counted as before
    blocks0, resident0, fused0 = sum(ly.mixer.decode_blocks for ly in layers), eng.runner.times.resident_steps, \
        _fused_steps(eng)
    runs0 = _layer_runs(eng)
    assert torch.equal(_decode(eng, ids, True, monkeypatch), want)
    assert sum(ly.mixer.decode_blocks for ly in layers) - blocks0 == len(layers) * len(ids)
    assert eng.runner.times.resident_steps - resident0 == len(layers) * len(ids)
    assert _fused_steps(eng) - fused0 == len(layers) * len(ids)
    assert _layer_runs(eng) - runs0 == len(ids)  # one native run a step


def _layer_runs(eng: Engine) -> int:
    """Native runs of DecodeLayers (the steps that took DecoderModel.decode_layers' stretches)."""
    plan = eng.model._all_layers
    return plan[2].runs if plan else 0


def _fused_steps(eng: Engine) -> int:
    """Layer steps whose routed experts ran inside the native decode layer."""
    return sum(t.used for t in eng.runner.tables.values() if t is not None)


@native
def test_decode_layer_experts_under_evictions(tmp_path, monkeypatch):
    """A budget holding 30% of the experts: steps mix the fused layer (all routed experts resident) with misses;
    the table never points at an evicted expert, and the logits stay those of the torch-only layer path."""
    synthesize("qwen3_moe", tmp_path / "m", "tiny", progress=False)
    eng = Engine.open(tmp_path / "m", ram_budget=expert_budget(tmp_path / "m", 0.3))
    eng.runner.lookahead.reads = 0
    ids = prompt_ids(eng.vocab_size, 24, seed=3)
    _decode(eng, ids[:8], True, monkeypatch)
    got = _decode(eng, ids, True, monkeypatch)
    for layer, table in eng.runner.tables.items():
        for e in range(table.experts if table is not None else 0):
            assert bool(table.rows[3 * e]) <= ((layer, e) in eng.runner.cache)
    assert _fused_steps(eng) > 0 and eng.runner.cache.stats.evictions > 0
    want = _decode(eng, ids, False, monkeypatch)
    assert max_rel_diff(got, want) < 1e-5
    block = _decode(eng, ids, "block", monkeypatch)
    # the layers' native runs, stopped at a miss, against one call a layer (each pass finds the cache as the one
    # before left it, so hits and reads, and the order a miss's experts are summed in, differ)
    assert max_rel_diff(got, block) < 1e-5


@native
def test_decode_block_layer_pieces_bit_for_bit(tmp_path):
    """One layer, step by step: h after attention, the post-norm input, the router's ids and weights, and the
    cache's new key and value rows equal the separate calls'."""
    synthesize("qwen3_moe", tmp_path / "m", "tiny", progress=False)
    eng = Engine.open(tmp_path / "m", ram_budget="1GB")
    layer = eng.model.layers[0]
    fast, slow = eng.new_sequence(), eng.new_sequence()
    g = torch.Generator().manual_seed(0)
    for _ in range(BLOCK_TOKENS + 3):
        h = torch.randn(1, layer.in_norm.shape[0], generator=g)
        h1, x2, ids, wts, done = layer.mixer.decode_block(h, Batch.build([(fast, 1)]), 0, layer.in_norm, layer.post_norm,
                                                    layer.eps, layer.ffn.router)
        h_want = h + layer.mixer(rms_norm(h, layer.in_norm, layer.eps), Batch.build([(slow, 1)]), 0)
        x_want = rms_norm(h_want, layer.post_norm, layer.eps)
        ids_want, wts_want = layer.ffn.router(x_want)
        assert not done and torch.equal(h1, h_want) and torch.equal(x2, x_want)
        assert torch.equal(ids, ids_want) and torch.equal(wts, wts_want)
        fast.pos += 1
        slow.pos += 1
    for a, b in ((fast.layers[0].k, slow.layers[0].k), (fast.layers[0].v, slow.layers[0].v)):
        assert len(a.blocks) == 2 and torch.equal(a.gather(), b.gather())


@native
def test_decode_block_sliding_window_matches_torch(tmp_path, monkeypatch):
    """A window shorter than the context drops whole KV blocks: the block kernel (absolute positions, keys from
    the held blocks) agrees with the torch path's windowed attention."""
    synthesize("mixtral", tmp_path / "w", "tiny", progress=False)
    cfg_path = tmp_path / "w" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["sliding_window"] = 20
    cfg_path.write_text(json.dumps(cfg))
    eng = Engine.open(tmp_path / "w", ram_budget="1GB")
    ids = prompt_ids(eng.vocab_size, 2 * BLOCK_TOKENS + 10, seed=7)
    got = _decode(eng, ids, True, monkeypatch)
    assert eng.model.layers[0].mixer.decode_blocks == len(ids)
    with cpu.disabled():
        want = _decode(eng, ids, True, monkeypatch)  # the torch path (the decode block needs the native kernels)
    assert max_rel_diff(got, want) < 1e-4
    assert [int(torch.argmax(r)) for r in got] == [int(torch.argmax(r)) for r in want]


@native
def test_decode_block_rejects_bad_operands():
    h, d = 32, 8
    w = gqa_block_weights(h, d)
    with pytest.raises(ValueError, match="contiguous bf16 o weight"):
        fused.DecodeBlock({**w, "o": w["o"].float()}, 4, 2, d, 1e-6, 1.0, 0.3, None, BLOCK_TOKENS)
    with pytest.raises(ValueError, match="router"):
        fused.DecodeBlock({**w, "router": torch.randn(8, h).bfloat16()}, 4, 2, d, 1e-6, 1.0, 0.3, None,
                          BLOCK_TOKENS, top_k=9)
    block = fused.DecodeBlock(w, 4, 2, d, 1e-6, 1.0, 0.3, None, BLOCK_TOKENS)
    with pytest.raises(ValueError, match="fp32 h"):
        block(torch.randn(2, h), [], [], 0, 1)
    with pytest.raises(ValueError, match="bad cache rows"):
        block(torch.randn(1, h), [], [], 0, 0)


@native
def test_pool_stats_count_threaded_calls(threads):
    """ms_pool_stats: a call split over two threads counts once; a one-thread call does not count; the caller's wait
    for started parts is a clock that only grows."""
    w, x = torch.randn(1024, 64).bfloat16(), torch.randn(1, 64)
    threads(1)
    before = cpu.pool_stats()
    cpu.linear_bf16(x, w)
    assert cpu.pool_stats()["runs"] == before["runs"]
    threads(2)
    got = cpu.linear_bf16(x, w)
    after = cpu.pool_stats()
    assert after["runs"] == before["runs"] + 1
    assert set(after) == {"runs", "caller_sleeps", "worker_sleeps", "long_waits", "prefetches", "prefetches_cut",
                          "prefetch_bytes", "taken", "shared_cpu", "wait_ns"}
    assert all(after[k] >= before[k] for k in after)
    assert torch.allclose(got, x @ w.float().T, rtol=1e-4, atol=1e-4)


@native
def test_background_prefetch_is_posted_stopped_and_changes_nothing(threads):
    """fused.prefetch hands the pool's workers regions to read ahead and returns at once; the next call stops them
    (or finds them done) and computes the same values. With more threads than workers so far, the next call starts
    new workers while the prefetch may still run (each must begin at the job posted after it was created)."""
    w, x = torch.randn(4096, 256).bfloat16(), torch.randn(1, 256)
    threads(1)
    want = cpu.linear_bf16(x, w)
    for n in (2, 3, 4, 2):
        threads(n)
        before = cpu.pool_stats()
        fused.prefetch(fused.prefetch_regions([w, x]))
        got = cpu.linear_bf16(x, w)
        after = cpu.pool_stats()
        assert after["prefetches"] == before["prefetches"] + 1
        assert after["prefetch_bytes"] <= before["prefetch_bytes"] + w.numel() * 2 + x.numel() * 4
        assert torch.equal(got, want)
    threads(1)
    before = cpu.pool_stats()
    fused.prefetch(fused.prefetch_regions([w]))  # one thread: nothing to hand it to
    assert cpu.pool_stats()["prefetches"] == before["prefetches"]


@native
def test_layer_times_count_decode_block_calls_only_while_on(tmp_path, monkeypatch):
    """cpu.layer_times: off, decode block calls leave the clocks at zero; on, each call counts once and its time
    lands in the phases (the experts' phase too once the warm steps run them inside the call); the read resets."""
    synthesize("qwen3_moe", tmp_path / "m", "tiny", progress=False)
    eng = Engine.open(tmp_path / "m", ram_budget="1GB")
    eng.runner.lookahead.reads = 0
    ids = prompt_ids(eng.vocab_size, 6, seed=3)
    cpu.layer_times(False)  # zero, off
    _decode(eng, ids, True, monkeypatch)  # also warms the expert cache
    assert cpu.layer_times(False)["calls"] == 0
    cpu.layer_times(True)
    try:
        _decode(eng, ids, True, monkeypatch)
        got = cpu.layer_times(True)  # read and zero, stays on
        assert cpu.layer_times(False)["calls"] == 0
    finally:
        cpu.layer_times(False)
    assert got["calls"] == len(eng.model.layers) * len(ids)
    assert set(got) == {*cpu.LAYER_PHASES, "calls"}
    assert got["q/k/v"] > 0 and got["experts"] > 0 and all(v >= 0 for v in got.values())


@native
def test_decode_layers_follow_each_sequence_cache(tmp_path, monkeypatch):
    """Two live sequences stepped in turn, one token a step, across a KV block boundary: each native run reads
    and writes its own sequence's cache blocks (the block addresses are rebuilt when the sequence or its blocks
    change), so the logits equal one call a layer's."""
    synthesize("qwen3_moe", tmp_path / "m", "tiny", progress=False)
    eng = Engine.open(tmp_path / "m", ram_budget="1GB")
    eng.runner.lookahead.reads = 0
    a, b = prompt_ids(eng.vocab_size, BLOCK_TOKENS + 4, seed=1), prompt_ids(eng.vocab_size, BLOCK_TOKENS + 4, seed=2)

    def interleaved(mode) -> list[torch.Tensor]:
        with monkeypatch.context() as m:
            if mode != "layers":
                m.setattr(DecoderModel, "decode_layers", lambda *x, **k: None)
            sa, sb = eng.new_sequence(), eng.new_sequence()
            try:
                return [eng.step([(s, [t])])[0] for ta, tb in zip(a, b) for s, t in ((sa, ta), (sb, tb))]
            finally:
                eng.free(sa)
                eng.free(sb)
    interleaved("block")  # warm the expert cache: then every step's experts are cached and grouped the same way
    runs0 = _layer_runs(eng)
    got = interleaved("layers")
    assert _layer_runs(eng) - runs0 >= 2 * len(a) - 2
    want = interleaved("block")
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@native
def test_decode_layers_reject_bad_operands(tmp_path, monkeypatch):
    """DecodeLayers refuses a row of the wrong width, a range outside its layers and tables of another router."""
    synthesize("qwen3_moe", tmp_path / "m", "tiny", progress=False)
    eng = Engine.open(tmp_path / "m", ram_budget="1GB")
    _decode(eng, prompt_ids(eng.vocab_size, 3, seed=4), True, monkeypatch)
    native = eng.model._all_layers[2]
    hidden = native.x2.shape[1]
    with pytest.raises(ValueError, match="fp32 contiguous h"):
        native(torch.zeros(1, hidden + 1))
    with pytest.raises(ValueError, match=r"layers \[2, 1\)"):
        native(torch.zeros(1, hidden), 2, 1)
    other = fused.ExpertTable(native.tables[0].experts + 1, hidden, "silu", 0.0, 0.0, lambda t: None)
    with pytest.raises(ValueError, match="expert table"):
        fused.DecodeLayers(native.blocks[:1], [other])
    with pytest.raises(ValueError, match="a table each"):
        fused.DecodeLayers(native.blocks, native.tables[:1])


@native
def test_a_native_run_keeps_the_books_as_layer_by_layer_steps(tmp_path, monkeypatch):
    """The bookkeeping of a token whose layers ran in native runs (ExpertRunner.resident_run, which does the
    non-reading layers' share inline and the policy's touches through its log) leaves the runner as one native call a
    layer with resident_done each does: hit counts per layer, the steps' counters, the quiet counts, the lookahead's
    scores and the cache policy's victims in order."""
    synthesize("qwen3_moe", tmp_path / "m", "tiny", progress=False)
    books = []
    for fast in (True, "block"):
        eng = Engine.open(tmp_path / "m", ram_budget="1GB")
        eng.runner.lookahead.reads = 0
        ids = prompt_ids(eng.vocab_size, BLOCK_TOKENS + 6, seed=9)
        _decode(eng, ids, "block", monkeypatch)  # the same warm-up for both
        runs0 = _layer_runs(eng)
        _decode(eng, ids, fast, monkeypatch)
        assert (_layer_runs(eng) > runs0) == (fast is True)
        r, stats = eng.runner, eng.runner.cache.stats
        books.append((stats.hits, stats.misses, dict(stats.layer_hits), r.times.steps, r.times.resident_steps,
                      dict(r._quiet), {k: (g.scored, g.recall) for k, g in r.lookahead.gates.items()},
                      list(r.cache.policy.victims())))
    assert books[0] == books[1]
