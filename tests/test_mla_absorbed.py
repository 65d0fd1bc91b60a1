"""MLA's kv_b prepared once per head (latent_heads.py) and the key-tiled online-softmax attention: every storage
form of kv_b (bf16 native, fp32, block-FP8, streamed) gives the same products as the dequantised matrix, the tiled
attention equals a full softmax, and the mixer's modes agree on bf16 weights and a bf16 latent cache."""
from __future__ import annotations

import pytest
import torch

from conftest import FakeWeights, max_rel_diff
from moestream.kernels import cpu
from moestream.kernels.qweight import BlockFp8Weight
from moestream.kernels.quant import dequant_fp8_block, quantize_fp8_block
from moestream.memory.accountant import MemoryAccountant
from moestream.memory.state import Batch, SeqState
from moestream.models import mla
from moestream.models.latent_heads import LatentHeads
from moestream.models.mla import MLAMixer, MLAOptions

H, DN, DV, R = 4, 16, 12, 32


def _kv_b(form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_b in `form`, its exact fp32 values [H * (dn + dv), r])."""
    w = torch.randn(H * (DN + DV), R) * 0.2
    if form == "fp8":
        q, s = quantize_fp8_block(w, (32, 32))
        return BlockFp8Weight.wrap(q, s, (32, 32)), dequant_fp8_block(q, s, (32, 32))
    if form == "fp32":
        return w, w
    b = w.to(torch.bfloat16)
    return b, b.float()


@pytest.mark.parametrize("form", ["bf16", "fp32", "fp8", "bf16-streamed"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_latent_heads_products_match_the_dequantised_kv_b(form, tokens):
    torch.manual_seed(0)
    kv_b, ref = _kv_b(form.split("-")[0])
    memory = MemoryAccountant(None)
    heads = LatentHeads(kv_b, H, DN, DV, R, None if form.endswith("streamed") else memory)
    ref = ref.view(H, DN + DV, R)
    q, ctx, c = torch.randn(H, tokens, DN), torch.randn(H, tokens, R), torch.randn(tokens, R)
    assert torch.allclose(heads.fold_query(q), torch.einsum("htd,hdr->htr", q, ref[:, :DN]), atol=1e-5)
    assert torch.allclose(heads.unfold_context(ctx), torch.einsum("htr,hvr->htv", ctx, ref[:, DN:]), atol=1e-5)
    keys, values = heads.expand(c)
    assert torch.allclose(keys, torch.einsum("hdr,lr->hld", ref[:, :DN], c), atol=1e-5)
    assert torch.allclose(values, torch.einsum("hvr,lr->hlv", ref[:, DN:], c), atol=1e-5)


def test_prepared_bytes_are_counted_once_at_load():
    torch.manual_seed(1)
    memory = MemoryAccountant(None)
    LatentHeads(_kv_b("fp8")[0], H, DN, DV, R, memory)
    assert memory.dense_bytes == H * (DN + DV) * R * 4  # dequantised once to fp32
    memory = MemoryAccountant(None)
    heads = LatentHeads(_kv_b("bf16")[0], H, DN, DV, R, memory)
    if cpu.available():  # the key half transposed for the native kernel: half of kv_b's bf16 bytes
        assert memory.dense_bytes == H * DN * R * 2 and heads.uk_t.shape == (H, R, DN)
    memory = MemoryAccountant(None)
    LatentHeads(_kv_b("fp32")[0], H, DN, DV, R, memory)
    assert memory.dense_bytes == 0  # fp32 kv_b is used in place
    LatentHeads(_kv_b("bf16")[0], H, DN, DV, R, None)  # streamed: nothing prepared, nothing counted


def _mixer_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    hidden, dr = 64, 8
    shapes = {"q_proj.weight": (H * (DN + dr), hidden), "kv_a_proj_with_mqa.weight": (R + dr, hidden),
              "kv_a_layernorm.weight": (R,), "kv_b_proj.weight": (H * (DN + DV), R), "o_proj.weight": (hidden, H * DV)}
    return {f"attn.{k}": (torch.randn(s) * 0.3 + (1.0 if len(s) == 1 else 0.0)).to(dtype) for k, s in shapes.items()}


def _run(tensors, mode: str, splits: list[int], kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    opts = MLAOptions(heads=H, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=8, v_head_dim=DV, mode=mode)
    mixer = MLAMixer(FakeWeights(tensors), "attn", opts)
    x = torch.randn(sum(splits), 64, generator=torch.Generator().manual_seed(4))
    state, outs = SeqState(MemoryAccountant(None), 1), []
    state.kv_dtype = kv_dtype  # the field memory/state.py's SeqState carries when --kv-dtype exists
    for n in splits:
        outs.append(mixer(x[state.pos:state.pos + n], Batch.build([(state, n)]), 0))
        state.pos += n
    assert state.layers[0].latents.dtype == kv_dtype
    return torch.cat(outs)


def test_block_fp8_kv_b_on_whole_blocks_stays_fp8(monkeypatch):
    """A block-FP8 kv_b whose heads fall on whole scale blocks keeps its codes: the key halves' codes and scales
    transposed once (counted), fold and unfold on the native FP8 kernel for fewer than FP8_NATIVE_MAX_T rows, a
    bounded upcast beyond; all within fp32 summation of float64 over the dequantised kv_b."""
    from moestream.kernels import quant

    h, dn, dv, r, block = 3, 128, 64, 192, (64, 64)
    if not quant.fp8_native(1, r, block):
        pytest.skip("no native AVX-512 FP8 kernel here")
    torch.manual_seed(2)
    q, s = quantize_fp8_block(torch.randn(h * (dn + dv), r) * 0.1, block)
    ref = dequant_fp8_block(q, s, block).double().view(h, dn + dv, r)
    memory = MemoryAccountant(None)
    heads = LatentHeads(BlockFp8Weight.wrap(q, s, block), h, dn, dv, r, memory)
    assert heads.w32 is None and heads.uk_t8[0].shape == (h * r, dn)
    assert memory.dense_bytes == h * r * dn + h * (r // 64) * (dn // 64) * 4  # an eighth of the fp32 bytes
    calls = []
    real = cpu.linear_fp8_heads
    monkeypatch.setattr(cpu, "linear_fp8_heads", lambda *a, **kw: calls.append(a[0].shape[1]) or real(*a, **kw))
    for n in (1, 5, quant.FP8_NATIVE_MAX_T):
        qn, ctx = torch.randn(h, n, dn), torch.randn(h, n, r)
        for got, x, w in ((heads.fold_query(qn), qn, ref[:, :dn]), (heads.unfold_context(ctx), ctx,
                                                                      ref[:, dn:].transpose(1, 2))):
            want, bound = x.double() @ w, x.double().abs() @ w.abs()
            assert bool(((got.double() - want).abs() <= 1e-5 * bound + 1e-30).all())
    assert calls == [1, 1, 5, 5]
    unaligned = LatentHeads(BlockFp8Weight.wrap(*quantize_fp8_block(torch.randn(h * 96, r), block), block),
                            h, 48, 48, r, MemoryAccountant(None))
    assert unaligned.uk_t8 is None and unaligned.w32 is not None  # 48-row halves: dequantised once, as before
    # streamed (nothing prepared, nothing counted): the same native calls, the key halves transposed per step, the
    # very bits of the resident products
    streamed = LatentHeads(BlockFp8Weight.wrap(q, s, block), h, dn, dv, r, None)
    assert streamed.uk_t8 is None and streamed.w32 is None and streamed.fp8_streamed
    calls.clear()
    for n in (1, 5):
        qn, ctx = torch.randn(h, n, dn), torch.randn(h, n, r)
        assert torch.equal(streamed.fold_query(qn), heads.fold_query(qn))
        assert torch.equal(streamed.unfold_context(ctx), heads.unfold_context(ctx))
    assert calls == [1, 1, 1, 1, 5, 5, 5, 5]


def test_bf16_weights_every_mode_matches_the_fp32_expansion():
    """bf16 kv_b takes the prepared per-head path (native kernel for decode rows); its result is the fp32 one."""
    bf16 = _mixer_tensors(torch.bfloat16)
    want = _run({k: v.float() for k, v in bf16.items()}, "expand", [30])
    for mode in ("expand", "absorb", "auto"):
        for splits in ([30], [5, 1, 1, 1, 22], [29, 1]):
            assert max_rel_diff(_run(bf16, mode, splits), want) < 1e-5, (mode, splits)


def test_bf16_latent_cache_stays_close():
    bf16 = _mixer_tensors(torch.bfloat16)
    want = _run(bf16, "auto", [20, 1, 1])
    got = _run(bf16, "auto", [20, 1, 1], kv_dtype=torch.bfloat16)
    assert max_rel_diff(got, want) < 2e-2


def test_attention_reads_the_cache_blocks_without_gathering_them(monkeypatch):
    """A cache of several blocks is attended tile by tile: BlockBuffer never hands out a gathered whole-cache copy
    (the old `append` returned one, fp32 and uncharged). Modes still agree, one sequence or a batched decode."""
    from moestream.memory.state import BLOCK_TOKENS, BlockBuffer

    def refuse(*_a, **_kw):
        raise AssertionError("MLA gathered the whole latent cache")

    monkeypatch.setattr(BlockBuffer, "gather", refuse)
    bf16 = _mixer_tensors(torch.bfloat16)
    splits = [2 * BLOCK_TOKENS + 7, 1, 1]
    want = _run(bf16, "expand", splits)
    assert max_rel_diff(_run(bf16, "absorb", splits), want) < 1e-5
    opts = MLAOptions(heads=H, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=8, v_head_dim=DV)
    mixer = MLAMixer(FakeWeights(bf16), "attn", opts)
    x = torch.randn(2 * BLOCK_TOKENS + 1, 64, generator=torch.Generator().manual_seed(5))

    def prefilled() -> list[SeqState]:  # two sequences of one and two blocks and a bit
        memory, states = MemoryAccountant(None), []
        for n in (BLOCK_TOKENS + 3, 2 * BLOCK_TOKENS):
            states.append(SeqState(memory, 1))
            mixer(x[:n], Batch.build([(states[-1], n)]), 0)
            states[-1].pos += n
        return states

    s = prefilled()
    both = mixer(x[-2:], Batch.build([(s[0], 1), (s[1], 1)]), 0)  # one batched absorbed decode step
    s = prefilled()
    alone = [mixer(x[-2 + i:x.shape[0] - 1 + i], Batch.build([(s[i], 1)]), 0) for i in range(2)]
    assert max_rel_diff(both, torch.cat(alone)) < 1e-5


def test_decode_never_allocates_a_whole_cache_copy():
    """At K3's latent width (512 + 64) and a 4096-token bf16 cache, no single allocation of a decode step comes near
    an fp32 copy of the cache (9.4 MB; the old `append` made one, uncharged): the largest is one key tile's."""
    from torch.profiler import ProfilerActivity, profile

    r, dr, hidden = 512, 64, 64
    gen = torch.Generator().manual_seed(7)
    shapes = {"q_proj.weight": (H * (DN + dr), hidden), "kv_a_proj_with_mqa.weight": (r + dr, hidden),
              "kv_a_layernorm.weight": (r,), "kv_b_proj.weight": (H * (DN + DV), r), "o_proj.weight": (hidden, H * DV)}
    tensors = {f"attn.{k}": (torch.randn(s, generator=gen) * 0.3 + (1.0 if len(s) == 1 else 0.0)).bfloat16()
               for k, s in shapes.items()}
    opts = MLAOptions(heads=H, kv_lora_rank=r, qk_nope_head_dim=DN, qk_rope_head_dim=dr, v_head_dim=DV)
    mixer = MLAMixer(FakeWeights(tensors), "attn", opts)
    state, x = SeqState(MemoryAccountant(None), 1), torch.randn(2, hidden, generator=gen)
    state.kv_dtype = torch.bfloat16
    mixer(x[:1], Batch.build([(state, 1)]), 0)
    cache = 4096
    state.layers[0].latents.push(torch.randn(cache - 1, r + dr, generator=gen))  # as a long prefill would leave it
    state.pos = cache
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mixer(x[1:], Batch.build([(state, 1)]), 0)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest < (cache + 1) * (r + dr) * 4 // 4, largest


def test_heads_kernel_matches_per_head_products():
    if not cpu.available():
        pytest.skip(cpu.reason())
    torch.manual_seed(6)
    w = torch.randn(5 * 40, 24).to(torch.bfloat16)  # 5 heads of [dn 16 | dv 24] rows, rank 24
    x = torch.randn(5, 3, 24)
    got = cpu.linear_bf16_heads(x, w, 16 * 24, 40 * 24, 24)  # each head's value half, read in place
    want = torch.einsum("htr,hvr->htv", x, w.float().view(5, 40, 24)[:, 16:])
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="overrun"):
        cpu.linear_bf16_heads(x, w, 17 * 24, 40 * 24, 24)
