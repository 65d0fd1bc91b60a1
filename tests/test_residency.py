"""Dense-weight residency: the planner's decisions under a budget, streamed layers / embedding rows / lm_head slabs
giving exactly the all-resident results within the budget, `info --ram-budget` printing the plan, and the error
when even streaming cannot fit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import prompt_ids, save_reference
from moestream import Engine
from moestream.engine import residency
from moestream.engine.engine import plan
from moestream.engine.residency import plan_residency
from moestream.errors import BudgetError

K3_CONFIG = Path(__file__).parent / "data" / "kimi_k3_config.json"
GB = 10**9


@pytest.fixture
def small_buffers(monkeypatch):
    """Slabs and row buffers small enough that a tiny model's embedding and lm_head are worth streaming."""
    monkeypatch.setattr(residency, "HEAD_SLAB_BYTES", 8192)
    monkeypatch.setattr(residency, "EMBED_ROWS_BYTES", 1024)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A Qwen3-MoE whose fp32 embedding and head (vocab 2048) outweigh everything else, with one dense-MLP layer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                         num_experts=8, num_experts_per_tok=2, mlp_only_layers=[2], norm_topk_prob=True,
                         initializer_range=0.1, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("qwen3_moe_residency")
    save_reference(Qwen3MoeForCausalLM, cfg, path)
    return path


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    from moestream.synth import synthesize

    path = tmp_path_factory.mktemp("k3_residency") / "k3"
    synthesize("kimi_k3", path, "tiny", seed=0, cache_dir=tmp_path_factory.mktemp("xdg"), progress=False)
    return path


@pytest.fixture(scope="module")
def k3_config_only(tmp_path_factory):
    """K3's real config.json alone, and its plan (sizing 82,432 experts from the inventory takes seconds: once)."""
    d = tmp_path_factory.mktemp("k3_config_only")
    shutil.copy(K3_CONFIG, d / "config.json")
    return d, plan(d)


KV_ROOM = 4 * 2 * 256 * 2 * 16 * 4 + 40 * 2048 * 4  # KV (layers x (k, v) x rows x kv heads x head dim x fp32) + the
# 40-token prompt's all-position logits, charged to the budget since issue #12


def _run(path: Path, budget: int | None, ids: list[int], n: int = 8, state_room: int = KV_ROOM):
    eng = Engine.open(path, ram_budget=budget, state_room=state_room)
    logits = eng.logits(ids)
    tokens = eng.generate(ids, n, stop_token_ids=[])
    return eng, logits, tokens


@pytest.fixture(params=["slots", "own storage"])
def layer_buffers(request, monkeypatch):
    """Streamed layers read into the two kept slots (O_DIRECT for each tensor's aligned inside), and as before
    into storage of their own (where a shard is not a local file or O_DIRECT is missing)."""
    if request.param == "own storage":
        monkeypatch.setattr(residency.DenseStreamer, "_plan_slots", lambda self, names: None)
    return request.param


def test_streamed_layers_embedding_and_head_equal_all_resident(qwen, small_buffers, layer_buffers):
    p = plan(qwen)
    ids = prompt_ids(2048, 40)
    _, want_logits, want_tokens = _run(qwen, None, ids)
    full = plan_residency(p, None, KV_ROOM)
    old_floor = p.dense_bytes + p.scratch_bytes + p.max_expert_bytes  # the old engine refused below this
    seen = set()
    for budget in (full.all_resident_budget, full.all_resident_budget - 1,
                   (full.min_ram_budget + full.all_resident_budget) // 2, full.min_ram_budget):
        eng, logits, tokens = _run(qwen, budget, ids)
        r, s = eng.residency, eng.stats
        assert torch.equal(logits, want_logits) and tokens == want_tokens, budget
        assert s["peak_resident_bytes"] <= budget
        assert s["dense_bytes"] == r.resident_dense_bytes and eng.memory.stream_bytes <= r.stream_buffer_bytes
        assert s["dense_stream_bytes_read"] > 0 or not r.streams
        seen.add((len(r.streamed_layers), r.embed_streamed, r.head_streamed))
        eng.close()
    # from everything resident to every MoE layer, the embedding and the head streamed (layer 2, the larger dense
    # MLP, stays: double-buffering it would cost more than it frees)
    assert (0, False, False) in seen and (3, True, True) in seen and len(seen) >= 3
    assert full.min_ram_budget < p.dense_bytes < old_floor  # runs below the dense bytes alone


def test_floor_budget_streams_everything_and_reads_it_every_step(qwen, small_buffers):
    p = plan(qwen)
    r = plan_residency(p, plan_residency(p, None, KV_ROOM).min_ram_budget, KV_ROOM)
    assert r.streamed_layers == [0, 1, 3] and r.embed_streamed and r.head_streamed
    assert r.resident_dense_bytes == r.pinned_bytes + r.layers[2].bytes
    assert r.layer_buffer_bytes == 2 * r.layers[0].bytes and r.layers[2].bytes > r.layers[0].bytes
    eng = Engine.open(qwen, ram_budget=r.ram_budget, state_room=KV_ROOM)
    state = eng.new_sequence()
    eng.step([(state, [5, 6, 7])])
    before = eng.stats["dense_stream_bytes_read"]
    eng.step([(state, [9])])
    per_step = eng.stats["dense_stream_bytes_read"] - before
    row = 64 * 4
    assert per_step == r.streamed_bytes_per_step + row  # every streamed layer, the head, one embedding row
    # between steps the books hold the two kept layer slots and the head's two slab buffers (kept from step to step)
    assert eng.memory.streamer._slots and eng.memory.stream_bytes == r.layer_buffer_bytes + 2 * r.head_slab_bytes


@pytest.mark.parametrize("direct", [True, False])
def test_a_streamed_heads_slabs_land_in_two_kept_buffers(qwen, small_buffers, monkeypatch, direct):
    """The head's slabs are read into the same two buffers every step (made once, counted while held), by O_DIRECT
    or, where that is refused, buffered into the same buffers: the all-resident logits and tokens either way."""
    ids = prompt_ids(2048, 40)
    _, want_logits, want_tokens = _run(qwen, None, ids)
    if not direct:
        monkeypatch.setattr(residency, "read_direct", lambda *a, **k: None)
    p = plan(qwen)
    r = plan_residency(p, plan_residency(p, None, KV_ROOM).min_ram_budget, KV_ROOM)
    eng, logits, tokens = _run(qwen, r.ram_budget, ids)
    assert eng.residency.head_streamed and torch.equal(logits, want_logits) and tokens == want_tokens
    kept = eng.memory.streamer._head_kept
    assert kept is not None and len(kept) == 2
    ids_before = [id(b) for b in kept]
    state = eng.new_sequence()
    eng.step([(state, [5, 6, 7])])
    assert [id(b) for b in eng.memory.streamer._head_kept] == ids_before
    assert eng.stats["peak_resident_bytes"] <= r.ram_budget
    eng.close()  # the kept head buffers and layer slots leave the books with the engine
    assert eng.memory.stream_bytes == 0 and eng.memory.streamer._head_kept is None


def test_a_streamed_heads_leading_rows_stay_resident_when_the_cache_has_room(qwen, small_buffers):
    """Between the floor and the all-resident budget some plans stream the head but keep its leading rows (whole
    slabs) resident out of the cache's room beyond 2 x top_k experts: the same logits and tokens as all resident,
    fewer bytes read a step, the budget kept."""
    p = plan(qwen)
    ids = prompt_ids(2048, 40)
    _, want_logits, want_tokens = _run(qwen, None, ids)
    full = plan_residency(p, None, KV_ROOM)
    budgets = range(full.min_ram_budget, full.all_resident_budget, 4096)
    partial = [b for b in budgets if 0 < plan_residency(p, b, KV_ROOM).head_resident_rows]
    assert partial, "no budget keeps part of the head"
    off = plan_residency(p, partial[-1], KV_ROOM, head_rows=False)  # many sequences' engines (batch job, server)
    assert off.head_resident_rows == 0 and off.cache_bytes > plan_residency(p, partial[-1], KV_ROOM).cache_bytes
    for budget in (partial[0], partial[len(partial) // 2], partial[-1]):
        r = plan_residency(p, budget, KV_ROOM)
        assert r.head_streamed and 0 < r.head_resident_rows < 2048 and r.head_resident_rows % 32 == 0
        eng, logits, tokens = _run(qwen, budget, ids)
        assert torch.equal(logits, want_logits) and tokens == want_tokens, budget
        assert eng.stats["peak_resident_bytes"] <= budget and eng.stats["dense_bytes"] == r.resident_dense_bytes
        state = eng.new_sequence()
        eng.step([(state, [5, 6, 7])])
        before = eng.stats["dense_stream_bytes_read"]
        eng.step([(state, [9])])
        row = 64 * 4
        got = eng.stats["dense_stream_bytes_read"] - before
        assert got == r.streamed_bytes_per_step + (row if r.embed_streamed else 0)
        assert got < r.head_bytes + sum(lr.bytes for lr in r.layers if lr.streamed)  # the resident rows not read
        eng.close()


def test_interrupted_step_leaves_no_layer_behind(qwen, small_buffers):
    p = plan(qwen)
    budget = plan_residency(p, None, KV_ROOM).min_ram_budget
    ids = prompt_ids(2048, 12)
    _, want, _ = _run(qwen, budget, ids, n=0)
    eng = Engine.open(qwen, ram_budget=budget, state_room=KV_ROOM)
    layer = eng.model.layers[2]
    calls = {"n": 0}

    def failing(h, batch, i):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return layer(h, batch, i)

    eng.model.layers[2] = failing
    with pytest.raises(RuntimeError, match="boom"):
        eng.logits(ids)
    assert torch.equal(eng.logits(ids), want)
    assert eng.stats["peak_resident_bytes"] <= budget


def test_k3_streamed_equals_all_resident(k3, small_buffers):
    """Kimi K3's own layer loop (AttnRes) streams too: cold runs, compared with no budget at all."""
    p = plan(k3)
    room = KV_ROOM * 8  # KV and recurrent state for the prompt and 8 tokens
    ids = prompt_ids(512, 16)
    full = plan_residency(p, None, room)
    _, want_logits, want_tokens = _run(k3, None, ids, state_room=room)
    seen = set()
    for budget in ((full.min_ram_budget + full.all_resident_budget) // 2, full.min_ram_budget):
        eng, logits, tokens = _run(k3, budget, ids, state_room=room)
        r = eng.residency
        seen.add((len(r.streamed_layers), r.embed_streamed, r.head_streamed))
        # the router lookahead's reads land on I/O threads, so which experts a step finds resident (computed in
        # one grouped call) or waits for (computed as each lands) varies, and with it the fp32 order in which
        # expert outputs are summed: equal to rounding, not bit for bit
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert tokens == want_tokens
        assert eng.stats["peak_resident_bytes"] <= budget
    assert (8, True, True) in seen and len(seen) == 2  # every layer, the embedding and the head at the floor


def test_budget_too_small_even_to_stream(qwen):
    p = plan(qwen)
    floor = plan_residency(p, None).min_ram_budget
    with pytest.raises(BudgetError) as e:
        Engine.open(qwen, ram_budget=floor - 1)
    msg = str(e.value)
    assert str(floor - 1) in msg and str(floor) in msg and str(p.dense_bytes) in msg and "streamed" in msg
    Engine.open(qwen, ram_budget=floor).close()  # the floor itself opens


def test_plan_invariants_on_k3_config(k3_config_only):
    """Config-only K3 (1.56 TB): budgets from 8 GB to 1 TB; each plan adds up to the budget, keeps top_k experts
    of cache, streams less as the budget grows, and keeps every dense weight at 256 GB."""
    p = k3_config_only[1]
    full = plan_residency(p, None)
    top_k = p.layout.top_k * p.max_expert_bytes
    last = None
    for budget in (8 * GB, 16 * GB, 32 * GB, 64 * GB, 100 * GB, 256 * GB, 1000 * GB):
        r = plan_residency(p, budget)
        assert r.resident_dense_bytes + r.stream_buffer_bytes + r.scratch_bytes + r.cache_bytes == budget
        assert r.cache_bytes >= r.min_cache_bytes == top_k
        streamed = sum(lr.bytes for lr in r.layers if lr.streamed) + (r.head_bytes if r.head_streamed else 0)
        assert streamed - r.head_resident_bytes == r.streamed_bytes_per_step
        if r.head_resident_rows:  # leading head rows held out of what the cache has beyond 2 x top_k experts
            assert r.head_streamed and r.cache_bytes >= residency.HEAD_ROWS_CACHE_KEEP * top_k
        assert r.layer_buffer_bytes == 2 * max([lr.bytes for lr in r.layers if lr.streamed], default=0)
        if last is not None:
            assert r.streamed_bytes_per_step <= last
        last = r.streamed_bytes_per_step
    assert plan_residency(p, 64 * GB).streamed_layers and not plan_residency(p, 256 * GB).streams
    assert full.min_ram_budget < 8 * GB < full.all_resident_budget < 256 * GB
    with pytest.raises(BudgetError, match=str(full.min_ram_budget)):
        plan_residency(p, 4 * GB)


def test_info_prints_the_plan(k3_config_only, capsys, monkeypatch):
    import moestream.info
    from moestream.cli import main

    path, p = k3_config_only
    monkeypatch.setattr(moestream.info, "plan", lambda _: p)
    assert main(["info", str(path), "--ram-budget", "64GB"]) == 0
    out = capsys.readouterr().out
    assert "residency:" in out and "streamed:   layers" in out and "read per step" in out
    assert "embedding:  not resident" in out
    assert main(["info", str(path), "--ram-budget", "64GB", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    r = info["budget"]["residency"]
    assert info["budget"]["fits"] and r["streamed_layers"] == plan_residency(p, 64 * GB).streamed_layers
    assert r["resident_dense_bytes"] + r["stream_buffer_bytes"] + r["scratch_bytes"] + r["cache_bytes"] == 64 * GB
    assert info["budget"]["cache_bytes"] == r["cache_bytes"]
    assert info["min_ram_budget"] < 8 * GB and info["all_resident_budget"] > info["dense_bytes"]
    r = plan_residency(p, 32 * GB)  # the head streams; the cache's room beyond 2 x top_k experts holds its first rows
    assert r.head_streamed and r.head_resident_rows > 0
    assert main(["info", str(path), "--ram-budget", "32GB"]) == 0
    assert f"lm_head:    first {r.head_resident_rows} rows resident" in capsys.readouterr().out


def test_layers_past_the_model_are_neither_resident_nor_streamed(qwen):
    """A checkpoint's extra layers (DeepSeek's multi-token-prediction layer) are never loaded: not planned."""
    from moestream.weights.index import TensorInfo

    p = plan(qwen)
    first = p.store.index["model.layers.0.self_attn.q_proj.weight"]
    extra = "model.layers.4.self_attn.q_proj.weight"
    p.store.index.tensors[extra] = TensorInfo(extra, first.file, first.offset, first.nbytes, first.dtype, first.shape)
    p.dense_names.append(extra)
    p.dense_bytes += first.nbytes
    r = plan_residency(p, None)
    assert [lr.layer for lr in r.layers] == [0, 1, 2, 3] and r.unread_bytes == first.nbytes
    assert r.resident_dense_bytes + r.unread_bytes == p.dense_bytes
