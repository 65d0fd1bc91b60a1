"""The paged batch decode attention (kernels/paged.py) against the per-sequence native path it replaces: same
outputs and same cache rows, bit for bit, for fp32, bf16, int8 and int4 caches; and a batch step takes it."""
from __future__ import annotations

import pytest
import torch

from moestream.kernels import cpu, fused, kvquant, paged
from moestream.memory.accountant import MemoryAccountant
from moestream.memory.state import BlockBuffer

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"native kernels unavailable: {cpu.reason()}")

HQ, HKV, D = 8, 2, 16


def _caches(lengths, dtype, gen, d=D):
    """Per sequence: K and V BlockBuffers holding lengths[s] - 1 rows (already normed and roped history)."""
    mem = MemoryAccountant(None)
    out = []
    for n in lengths:
        k, v = BlockBuffer(mem, (HKV, d), dtype=dtype), BlockBuffer(mem, (HKV, d), dtype=dtype)
        if n > 1:
            k.push(torch.randn(n - 1, HKV, d, generator=gen))
            v.push(torch.randn(n - 1, HKV, d, generator=gen) * torch.rand(n - 1, HKV, 1, generator=gen))
        out.append((k, v))
    return out


def _per_sequence(caches, q, k, v, norms, inv_freq):
    """What attention._native_call does for one decoding sequence at a time."""
    outs = []
    for s, (kb, vb) in enumerate(caches):
        kb.push(k[s:s + 1])
        vb.push(v[s:s + 1])
        keys, values = kb.gather(), vb.gather()
        got = fused.gqa_attend(q[s:s + 1].contiguous(), keys, values, 1, 0.3, *norms, 1e-6, inv_freq, 1.0)
        if not (len(kb.blocks) == 1 and kb.dtype == torch.float32):
            kb.overwrite_tail(keys[keys.shape[0] - 1:])
        outs.append(got)
    return torch.cat(outs)


@pytest.mark.parametrize("dtype,d", [(torch.float32, D), (torch.bfloat16, D), (torch.int8, D), (torch.int8, 128),
                                     (kvquant.INT4, D), (kvquant.INT4, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_equals_per_sequence(dtype, d, threads):
    """int8 / int4 at D=16 keep one scale per head row, at D=128 two (groups of 64)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 2, 63, 64, 65, 130, 7]
    b = len(lengths)
    q, k, v = (torch.randn(b, h, d, generator=gen) for h in (HQ, HKV, HKV))
    v[3] = 0.0  # an all-zero value row: scale 0 in an int8 / int4 cache
    norms = (torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    old = _caches(lengths, dtype, torch.Generator().manual_seed(1), d)
    new = _caches(lengths, dtype, torch.Generator().manual_seed(1), d)
    want = _per_sequence(old, q.clone(), k, v, norms, inv_freq)
    for kb, vb in new:
        kb.reserve(1)
        vb.reserve(1)
    before = cpu.threads()
    cpu.set_threads(threads)
    try:
        got = paged.gqa_decode_paged(q.clone(), k, v, [kb.length for kb, _ in new], [kb.blocks for kb, _ in new],
                                     [vb.blocks for _, vb in new], 0.3, *norms, 1e-6, inv_freq, 1.0, dtype,
                                     new[0][0].block)
    finally:
        cpu.set_threads(before)
    assert torch.equal(got, want)
    for (ko, vo), (kn, vn) in zip(old, new):
        assert torch.equal(ko.view(), kn.view()) and torch.equal(vo.view(), vn.view())
        for a, c in zip(ko.blocks + vo.blocks, kn.blocks + vn.blocks):  # the stored bytes too (values, scales)
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))


def test_paged_rejects_rows_beyond_its_blocks():
    mem = MemoryAccountant(None)
    kb, vb = BlockBuffer(mem, (HKV, D)), BlockBuffer(mem, (HKV, D))
    kb.reserve(1)
    vb.reserve(1)
    q, k, v = torch.zeros(1, HQ, D), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D)
    with pytest.raises(ValueError, match="do not fit"):
        paged.gqa_decode_paged(q, k, v, [65], [kb.blocks], [vb.blocks], 1.0)


def test_reserve_charges_like_push():
    mem = MemoryAccountant(1 << 30)
    a, b = BlockBuffer(mem, (HKV, D)), BlockBuffer(mem, (HKV, D))
    for _ in range(70):
        a.push(torch.zeros(1, HKV, D))
        b.reserve(1)
    assert (a.length, len(a.blocks), a.nbytes) == (b.length, len(b.blocks), b.nbytes)
    assert mem.state_bytes == 2 * a.nbytes


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8", "int4"])
def test_batch_decode_step_takes_the_paged_path_and_equals_one_at_a_time(tmp_path_factory, monkeypatch, kv):
    """Three sequences decoding together (one paged call per layer) give each the logits it gets decoding alone (up
    to fp32 summation order: the projections and experts of a 3-row step run other kernels than a 1-row step's)."""
    from moestream import Engine
    from tests.conftest import prompt_ids, synth_tiny

    path = synth_tiny(tmp_path_factory, "qwen3_moe")
    eng = Engine.open(path, kv_dtype=kv)
    prompts = [prompt_ids(eng.vocab_size, n, seed=n) for n in (5, 64, 70)]
    nxt = [3, 4, 5]
    alone = []
    for ids, t in zip(prompts, nxt):
        st = eng.new_sequence()
        eng.step([(st, ids)])
        alone.append(eng.step([(st, [t])])[0])
        eng.free(st)
    calls = []
    real = paged.gqa_decode_paged
    monkeypatch.setattr(paged, "gqa_decode_paged", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    states = [eng.new_sequence() for _ in prompts]
    for st, ids in zip(states, prompts):
        eng.step([(st, ids)])
    together = eng.step([(st, [t]) for st, t in zip(states, nxt)])
    assert calls and set(calls) == {3}
    for a, b in zip(alone, together):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert int(a.argmax()) == int(b.argmax())


@pytest.mark.parametrize("kv", ["fp32", "bf16", "int8", "int4"])
def test_a_step_that_also_prefills_decodes_its_sequences_in_the_paged_call(tmp_path_factory, monkeypatch, kv):
    """Three sequences decoding in the same step as a new prompt's prefill: the decoding rows still take one paged
    call per layer (not the padded torch path), and every sequence gets the logits of a step without the prompt,
    the prompt those of its prefill alone (int8: its rows quantised once for the step's prompts)."""
    from moestream import Engine
    from tests.conftest import prompt_ids, synth_tiny

    path = synth_tiny(tmp_path_factory, "qwen3_moe")
    eng = Engine.open(path, kv_dtype=kv)
    prompts = [prompt_ids(eng.vocab_size, n, seed=n) for n in (5, 64, 70)]
    newcomer = prompt_ids(eng.vocab_size, 40, seed=40)
    nxt = [3, 4, 5]

    def prefilled():
        states = [eng.new_sequence() for _ in prompts]
        for st, ids in zip(states, prompts):
            eng.step([(st, ids)])
        return states

    states = prefilled()
    decode_only = eng.step([(st, [t]) for st, t in zip(states, nxt)])
    st = eng.new_sequence()
    prompt_alone = eng.step([(st, newcomer)])[0]
    for s in states + [st]:
        eng.free(s)
    calls = []
    real = paged.gqa_decode_paged
    monkeypatch.setattr(paged, "gqa_decode_paged", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    states = prefilled()
    st = eng.new_sequence()
    mixed = eng.step([(s, [t]) for s, t in zip(states, nxt)] + [(st, newcomer)])
    assert calls and set(calls) == {3}
    for a, b in zip(list(decode_only) + [prompt_alone], mixed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert int(a.argmax()) == int(b.argmax())


@pytest.mark.parametrize("dtype", [torch.int8, kvquant.INT4])
def test_portable_build_stores_and_reads_quantised_rows_the_same(tmp_path, monkeypatch, dtype):
    """The scalar build (no -march=native) writes the same quantised rows and attends to the same outputs as the
    torch path, as the native build does (test_paged_equals_per_sequence)."""
    if cpu.shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu, "FLAGS", ("-O2", "-fPIC", "-shared", "-pthread"))
    cpu.reset()
    try:
        assert cpu.available() and not cpu.simd(), cpu.reason()
        test_paged_equals_per_sequence(dtype, 128, 1)
    finally:
        monkeypatch.undo()
        cpu.reset()
