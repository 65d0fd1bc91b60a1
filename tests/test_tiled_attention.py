"""Attention in key tiles (models/tiled.py) against the naive full-matrix form, KV blocks (memory/state.py):
exact accounting, bounded sliding windows, bf16 storage; all-position logits and KDA scratch charged to the budget."""
from __future__ import annotations

import pytest
import torch

from conftest import max_rel_diff, prompt_ids, reference_greedy, reference_logits, save_reference
from moestream import Engine
from moestream.errors import BudgetError
from moestream.memory.accountant import MemoryAccountant
from moestream.server.prefix import buffers
from moestream.memory.state import BLOCK_HOST_BYTES, BLOCK_TOKENS, BlockBuffer, SeqState, Segment
from moestream.models import tiled
from moestream.models.attention import KVSlot, attend, causal_mask, cached_attention, decode_attention

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 256


def naive(q, k, v, scale, q_pos=0, k_pos=0, window=None, sinks=None):
    """q [Hq, Tq, D], k/v [Hkv, Tk, D]: the whole score matrix, masked, softmaxed (with a sink column)."""
    hq, tq, _ = q.shape
    g = hq // k.shape[0]
    kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = q @ kk.transpose(1, 2) * scale
    qp = torch.arange(q_pos, q_pos + tq).unsqueeze(1)
    kp = torch.arange(k_pos, k_pos + k.shape[1]).unsqueeze(0)
    ok = kp <= qp
    if window is not None:
        ok &= kp > qp - window
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(hq, 1, 1).expand(hq, tq, 1)], dim=-1)
    return (torch.softmax(s, -1)[..., :k.shape[1]]) @ vv


SMALL = 6000  # a scratch budget of a few query rows and keys per tile: every call crosses many tiles and blocks


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(tiled, "KEY_TILE", 7)


@pytest.mark.parametrize("hq,hkv,tq,past,window,sink", [
    (8, 2, 33, 0, None, False), (8, 2, 9, 40, None, False), (4, 4, 30, 11, 6, False), (6, 3, 20, 25, 9, True),
    (4, 1, 1, 50, None, True), (4, 2, 17, 0, 1, False)])
def test_tiled_equals_naive(small_tiles, hq, hkv, tq, past, window, sink):
    g = torch.Generator().manual_seed(hq * 100 + tq + past)
    q = torch.randn(hq, tq, 16, generator=g)
    k, v = torch.randn(2, hkv, past + tq, 16, generator=g) * 2
    sinks = torch.randn(hq, generator=g) if sink else None
    got = tiled.tiled_attention(q, k, v, 0.3, q_pos=past, window=window, sinks=sinks, budget=SMALL)
    want = naive(q, k, v, 0.3, past, 0, window, sinks)
    assert max_rel_diff(got, want) < 1e-5
    batched = tiled.tiled_attention(torch.stack([q, q]), torch.stack([k, k]), torch.stack([v, v]), 0.3, q_pos=past,
                                    window=window, sinks=sinks, budget=SMALL)  # leading dims
    assert torch.allclose(batched[1], got, atol=1e-6)


def test_tiled_keys_from_an_offset(small_tiles):
    """Keys that start later than position 0 (a window's dropped blocks): q_pos and k_pos are absolute."""
    q, k, v = torch.randn(4, 5, 8), torch.randn(2, 20, 8), torch.randn(2, 20, 8)
    got = tiled.tiled_attention(q, k, v, 0.5, q_pos=100, k_pos=85, window=12, budget=SMALL)
    assert max_rel_diff(got, naive(q, k, v, 0.5, 100, 85, 12)) < 1e-5


def test_block_buffer_accounting_and_reads():
    mem = MemoryAccountant(None)
    buf = BlockBuffer(mem, (2, 3))
    rows = torch.randn(150, 2, 3)
    buf.push(rows[:1])
    assert buf.block_bytes == BLOCK_TOKENS * 6 * 4 and buf.block_charge == buf.block_bytes + BLOCK_HOST_BYTES
    assert mem.state_bytes == buf.nbytes == buf.block_charge
    buf.push(rows[1:130])
    assert len(buf.blocks) == 3 and mem.state_bytes == 3 * buf.block_charge
    assert buf.growth(20) == 0 and buf.growth(70) == buf.block_charge
    buf.push(rows[130:])
    assert torch.equal(buf.gather(), rows) and torch.equal(torch.cat([t for _, t in buf.tiles()]), rows)
    buf.overwrite_tail(torch.zeros(30, 2, 3))
    assert torch.equal(buf.gather()[:120], rows[:120]) and buf.gather()[120:].abs().sum() == 0
    copy = buf.clone(70)
    assert copy.length == 70 and len(copy.blocks) == 2 and buf.clone_bytes(70) == 2 * buf.block_charge
    buf.release()
    assert mem.state_bytes == 0


def test_block_buffer_never_exceeds_the_budget():
    block = BLOCK_TOKENS * 4 * 4 + BLOCK_HOST_BYTES  # charged a block: its rows and its tensor object
    mem = MemoryAccountant(3 * block)
    buf = BlockBuffer(mem, (4,))
    buf.push(torch.zeros(150, 4))
    assert mem.state_bytes == 3 * block
    with pytest.raises(BudgetError, match="KV cache"):
        buf.push(torch.zeros(50, 4))  # a fourth block
    assert mem.state_bytes == 3 * block and buf.length == 150 and mem.peak <= mem.budget


@pytest.mark.parametrize("allowance", [None, 3000])
def test_sliding_window_cache_is_bounded_and_exact(allowance):
    """A window of 20 over 600 tokens fed in chunks, then decoded: the cache keeps at most window + chunk + one
    block of rows, and every step's output equals attention over the full history (also with a scratch allowance
    so small that key tiles are cut inside blocks)."""
    torch.manual_seed(0)
    mem, window, total = MemoryAccountant(None if allowance is None else 1 << 30), 20, 600
    mem.scratch_bytes = allowance or 0
    slot = KVSlot(mem, 2, 8, 8, window=window)
    q, k, v = torch.randn(total, 4, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    sinks = torch.randn(4)
    pos, most = 0, 0
    for n in [100, 37, 200] + [1] * 263:
        seg = Segment(SeqState(mem, 1), 0, n, pos)
        got = cached_attention(seg, slot, q[pos:pos + n], k[pos:pos + n], v[pos:pos + n], 0.4, window, sinks)
        want = attend(q[pos:pos + n], k[:pos + n], v[:pos + n], causal_mask(pos, n, pos + n, window), 0.4, sinks)
        assert max_rel_diff(got, want) < 1e-5
        most = max(most, slot.k.kept)
        assert slot.k.kept <= window + n + BLOCK_TOKENS
        pos += n
    assert slot.k.start > 0 and slot.k.kept <= window + BLOCK_TOKENS
    assert mem.state_bytes == 2 * slot.k.nbytes == 2 * len(slot.k.blocks) * slot.k.block_charge


def test_batched_decode_over_windowed_blocks():
    torch.manual_seed(1)
    mem, window = MemoryAccountant(None), 30
    lens = [5, 70, 140]
    slots, hist = [], []
    for n in lens:
        s = KVSlot(mem, 2, 8, 8, window=window)
        kv = torch.randn(2, n, 2, 8)
        s.k.push(kv[0])
        s.v.push(kv[1])
        slots.append(s)
        hist.append(kv)
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    got = decode_attention(slots, q, k, v, 0.3, window)
    for i, n in enumerate(lens):
        keys, values = torch.cat([hist[i][0], k[i:i + 1]]), torch.cat([hist[i][1], v[i:i + 1]])
        want = attend(q[i:i + 1], keys, values, causal_mask(n, 1, n + 1, window), 0.3)
        assert max_rel_diff(got[i:i + 1], want) < 1e-5


# ---- engine: mixtral with a tiny window, bf16 KV, charged scratch ------------------------------------------------
@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, initializer_range=0.1,
                        intermediate_size=64, num_local_experts=8, sliding_window=8, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    path = tmp_path_factory.mktemp("mixtral_window")
    return path, save_reference(MixtralForCausalLM, cfg, path)


def test_mixtral_sliding_window_parity(windowed):
    """Prompt 150 tokens, window 8: blocks are dropped, logits and greedy tokens still match transformers."""
    path, ref = windowed
    ids = prompt_ids(VOCAB, 150)
    eng = Engine.open(path, prefill_chunk=40)
    assert max_rel_diff(eng.logits(ids), reference_logits(ref, ids)) < 1e-3
    assert eng.generate(ids, 12, stop_token_ids=[]) == reference_greedy(ref, ids, 12)
    state = eng.new_sequence()
    eng.prefill(state, ids)
    for t in range(100):
        eng.step([(state, [t])])
    per_layer = 2 * (-(-(8 + BLOCK_TOKENS) // BLOCK_TOKENS) + 1) * BLOCK_TOKENS * 2 * 16 * 4
    assert eng.memory.state_bytes <= 2 * per_layer  # two layers, bounded by the window, not by 250 tokens
    eng.free(state)


def test_bf16_kv_close_to_fp32(windowed):
    """bf16 storage rounds keys and values (~3 significant digits): typical positions move ~1e-3; a random tiny
    MoE's near-tied routers flip an expert at a few positions, so the bound is on the median and 80% of them."""
    path, _ = windowed
    ids = prompt_ids(VOCAB, 90)
    fp32, bf16 = Engine.open(path), Engine.open(path, kv_dtype="bf16")
    a, b = fp32.logits(ids), bf16.logits(ids)
    per_pos = (a - b).abs().amax(-1) / a.abs().amax()
    assert float(per_pos.median()) < 5e-3 and float(per_pos.quantile(0.8)) < 1e-2
    assert bf16.generate(ids, 16, stop_token_ids=[]) == fp32.generate(ids, 16, stop_token_ids=[])
    state = bf16.new_sequence()
    bf16.prefill(state, ids[:64])
    host = BLOCK_HOST_BYTES * sum(len(b.blocks) for b in buffers(state))  # charged per block, whatever its dtype
    half = bf16.memory.state_bytes - host
    bf16.free(state)
    state = fp32.new_sequence()
    fp32.prefill(state, ids[:64])
    assert fp32.memory.state_bytes - host == 2 * half
    fp32.free(state)


def test_bad_kv_dtype_is_a_clear_error(windowed):
    from moestream.errors import MoestreamError

    with pytest.raises(MoestreamError, match="--kv-dtype must be one of fp32, bf16"):
        Engine.open(windowed[0], kv_dtype="fp8")


def test_all_position_logits_are_charged(windowed):
    """A budget that holds the model, its KV cache and one expert, with less spare than 150 x vocab fp32 logits:
    the last-token prefill runs, asking for every position's logits is a BudgetError (not an overrun)."""
    path, _ = windowed
    ids = prompt_ids(VOCAB, 150)
    probe = Engine.open(path)
    state = probe.new_sequence()
    probe.prefill(state, ids)
    kv = probe.memory.state_bytes
    probe.free(state)
    logits = len(ids) * VOCAB * 4
    budget = probe.memory.fixed() + kv + logits // 8 + probe.plan.max_expert_bytes  # attention: in the allowance
    eng = Engine.open(path, ram_budget=budget)
    state = eng.new_sequence()
    eng.prefill(state, ids)
    eng.free(state)
    with pytest.raises(BudgetError, match="RAM budget"):  # the logits are charged first: whatever comes next fails
        eng.logits(ids)
    assert eng.memory.state_bytes == 0 and eng.stats["peak_resident_bytes"] <= budget


def test_kda_chunk_scratch_inside_the_allowance(tmp_path_factory):
    """Kimi Linear: the scratch allowance holds at least one head's chunk, the chunked prefill plans its head
    groups inside it, and a run under a budget of exactly dense + scratch + state + one expert stays inside."""
    from conftest import synth_tiny
    from moestream.models import kda

    path = synth_tiny(tmp_path_factory, "kimi_linear")
    probe = Engine.open(path)
    opt = probe.plan.config.kda
    room = probe.memory.scratch_bytes
    group, nbytes = kda.chunk_plan(opt.heads, 128, opt.chunk, opt.head_dim, opt.head_dim, room)
    assert 1 <= group and nbytes <= room
    ids = prompt_ids(probe.vocab_size, 128)
    state = probe.new_sequence()
    probe.prefill(state, ids)
    held = probe.memory.state_bytes
    probe.free(state)
    budget = probe.memory.fixed() + held + probe.plan.max_expert_bytes
    eng = Engine.open(path, ram_budget=budget)
    state = eng.new_sequence()
    eng.prefill(state, ids)
    eng.free(state)
    assert eng.memory.state_bytes == 0 and eng.stats["peak_resident_bytes"] <= budget


def test_scratch_over_the_allowance_is_charged():
    """What a compute phase needs beyond the fixed allowance is charged while it runs: BudgetError when it does not
    fit, nothing left charged after."""
    from moestream.memory.state import scratch

    mem = MemoryAccountant(10_000)
    mem.scratch_bytes = 4_000
    with scratch(mem, 9_000, "KDA chunk scratch"):
        assert mem.state_bytes == 5_000
    with pytest.raises(BudgetError, match="KDA chunk scratch"):
        with scratch(mem, 11_000, "KDA chunk scratch"):
            pass
    assert mem.state_bytes == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,t", [(8, 2, 300), (4, 4, 17), (6, 3, 1)])
def test_a_fresh_prompt_takes_flash_attention_and_matches(monkeypatch, dtype, hq, hkv, t):
    """A whole prompt over an empty cache goes to torch's flash kernel (models/attention._fresh_attention), with
    the cache's stored (bf16-rounded) keys, charged while it runs; a chunk after it still goes through the tiles.
    Both equal attention over the full history."""
    from moestream.models import attention

    calls = []
    real = attention._fresh_attention
    monkeypatch.setattr(attention, "_fresh_attention", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    torch.manual_seed(t)
    mem = MemoryAccountant(1 << 30)
    slot = KVSlot(mem, hkv, 16, 16, dtype)
    q, k, v = torch.randn(t + 9, hq, 16), torch.randn(t + 9, hkv, 16), torch.randn(t + 9, hkv, 16)
    stored = (k.to(dtype).float(), v.to(dtype).float())
    for pos, n in ((0, t), (t, 9)):
        got = cached_attention(Segment(SeqState(mem, 1), 0, n, pos), slot, q[pos:pos + n], k[pos:pos + n],
                               v[pos:pos + n], 0.25)
        want = attend(q[pos:pos + n], stored[0][:pos + n], stored[1][:pos + n], causal_mask(pos, n, pos + n, None),
                      0.25)
        assert max_rel_diff(got, want) < 1e-5
    assert calls == [t]
    assert mem.state_bytes == 2 * slot.k.nbytes  # the scratch was given back
    # its blocks and output are charged: a budget holding the cache but not them is a clear error
    cache = 2 * slot.k.layout.charge_at(t)  # the pages its t rows take and each block's tensor object
    tight = MemoryAccountant(cache + 64)
    with pytest.raises(BudgetError, match="attention scratch"):
        cached_attention(Segment(SeqState(tight, 1), 0, t, 0), KVSlot(tight, hkv, 16, 16, dtype), q[:t], k[:t],
                         v[:t], 0.25)
