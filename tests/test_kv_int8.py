"""`--kv-dtype int8`: grouped int8 KV / latent rows (kernels/kvquant.py) in BlockBuffer's blocks, their bytes charged
as stored, the error bounded by the group's scale, and the engine's logits near fp32's for a GQA, an MLA + KDA
(Kimi K3) and a Kimi Linear tiny checkpoint."""
from __future__ import annotations

import pytest
import torch

from conftest import prompt_ids, synth_tiny
from moestream.kernels import kvquant
from moestream.memory.accountant import MemoryAccountant
from moestream.memory.slabs import blocks_out
from moestream.memory.state import BLOCK_TOKENS, BlockBuffer, block_shape, kv_dtype


def test_quantize_error_is_within_half_a_step_of_each_group():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 128, generator=g) * torch.rand(50, 4, 1, generator=g) * 10
    x[3, 1, 64:] = 0.0  # a zero group
    q, s = kvquant.quantize(x)
    assert q.dtype == torch.int8 and s.shape == (50, 4, 2) and q.abs().max() <= 127
    back = kvquant.dequantize(q, s)
    step = s.repeat_interleave(64, dim=-1)
    assert bool(((back - x).abs() <= step / 2 + 1e-6 * x.abs()).all())
    assert float(s[3, 1, 1]) == 0.0 and bool((back[3, 1, 64:] == 0).all())
    assert torch.equal(kvquant.roundtrip(x), back)
    # a width 64 does not divide keeps one scale per row
    assert kvquant.group_of(48) == 48 and kvquant.row_bytes((2, 48)) == 96 + 8
    assert kvquant.row_bytes((8, 128)) == 8 * 128 + 8 * 2 * 4


def test_block_buffer_int8_stores_charges_and_reads_back():
    mem = MemoryAccountant(1 << 30)
    buf = BlockBuffer(mem, (2, 128), dtype=torch.int8)
    rows = torch.randn(150, 2, 128, generator=torch.Generator().manual_seed(1))
    buf.push(rows[:100])
    buf.push(rows[100:])
    assert buf.row_bytes == 2 * 128 + 2 * 2 * 4
    # a block fills whole pages (the slab slot it takes) with as many rows as fit: 75 of 272 bytes in 5 pages
    assert (buf.block, buf.block_bytes) == (75, 5 * 4096) == block_shape(272, 8)
    assert block_shape(272) == (BLOCK_TOKENS, BLOCK_TOKENS * 272)
    assert mem.state_bytes == buf.nbytes == 2 * buf.block_charge
    assert torch.equal(buf.gather(), kvquant.roundtrip(rows))
    assert buf.tile_dtype == torch.float32 and buf.view().dtype == torch.float32
    check_tail_edge_clone(mem, buf, rows, 8)


def check_tail_edge_clone(mem: MemoryAccountant, buf: BlockBuffer, rows: torch.Tensor, bits: int) -> None:
    """A quantised BlockBuffer `buf` holding `rows` (its last rows inside one block): overwrite_tail inside a block
    and across a block edge, a clone of a block and a half, and every block given back (int8 and int4 tests)."""
    new = torch.randn(4, *rows.shape[1:])
    buf.overwrite_tail(new)  # within the last block
    assert torch.equal(buf.gather()[-4:], kvquant.roundtrip(new, bits))
    b = buf.block
    edge = BlockBuffer(mem, tuple(rows.shape[1:]), dtype=buf.dtype)
    edge.push(rows[:b + 2])
    edge.overwrite_tail(new)  # rows b - 2 .. b + 1 span the edge
    assert torch.equal(edge.gather()[b - 2:], kvquant.roundtrip(new, bits))
    assert torch.equal(edge.gather()[:b - 2], kvquant.roundtrip(rows[:b - 2], bits))
    n = b + b // 2
    copy = buf.clone(n)
    mem.grow_state(copy.clone_bytes(), "clone")  # as server/prefix.py charges a clone
    # a whole block and the pages of the second's rows (less than two blocks)
    assert torch.equal(copy.gather(), buf.gather()[:n]) and copy.clone_bytes() == buf.layout.charge_at(n)
    assert buf.block_charge < copy.clone_bytes() < 2 * buf.block_charge
    copy.release()
    before, held = blocks_out(), len(buf.blocks) + len(edge.blocks)
    buf.release()
    edge.release()
    assert mem.state_bytes == 0 and blocks_out() == before - held


@pytest.mark.parametrize("name, bits, n", [("int8", 8, 300), ("int4", 4, 600)])
def test_block_buffer_quantized_window_drops_blocks(name, bits, n):
    mem = MemoryAccountant(None)
    buf = BlockBuffer(mem, (1, 64), dtype=kv_dtype(name), window=16)
    rows = torch.randn(n, 1, 64)
    for i in range(n):
        buf.push(rows[i:i + 1])
    assert len(buf.blocks) <= 2 and buf.length == n
    assert torch.equal(buf.gather()[-16:], kvquant.roundtrip(rows[-16:], bits))


@pytest.mark.parametrize("family", ["qwen3_moe", "kimi_k3", "kimi_linear"])
def test_int8_kv_close_to_fp32(tmp_path_factory, family):
    """int8 rows keep ~2 significant digits a group; the logits of a prompt and of decode steps stay near fp32's.
    A random tiny MoE's near-tied routers flip an expert at a few positions, so the bound is on the median and 80%
    of positions, as for bf16 (tests/test_tiled_attention.py); int8's bounds are 2x looser (measured: medians
    0.0029 / 0.0004 / 0.0006 against bf16's 0.0010 / 0.0002 / 0.0002)."""
    from moestream import Engine

    path = synth_tiny(tmp_path_factory, family)
    fp32, int8 = Engine.open(path), Engine.open(path, kv_dtype="int8")
    try:
        ids = prompt_ids(fp32.vocab_size, 90)
        a, b = fp32.logits(ids), int8.logits(ids)
        per_pos = (a - b).abs().amax(-1) / a.abs().amax()
        assert float(per_pos.median()) < 1e-2 and float(per_pos.quantile(0.8)) < 2e-2, family
        # the decode path (one token a step over the stored cache) too
        steps = []
        for eng in (fp32, int8):
            st = eng.new_sequence()
            eng.step([(st, ids[:70])])
            steps.append(torch.stack([eng.step([(st, [t])])[0] for t in ids[70:80]]))
            eng.free(st)
        rel = (steps[0] - steps[1]).abs().amax(-1) / steps[0].abs().amax()
        assert float(rel.median()) < 1e-2, family
        assert int8.memory.state_bytes == 0
    finally:
        fp32.close()
        int8.close()


def held_state(path, kv_dtypes, prompt_len: int) -> dict:
    """The state bytes one sequence's prefill of `prompt_len` tokens books, per KV dtype."""
    from moestream import Engine

    held = {}
    for kv in kv_dtypes:
        eng = Engine.open(path, kv_dtype=kv)
        st = eng.new_sequence()
        eng.prefill(st, prompt_ids(eng.vocab_size, prompt_len))
        held[kv] = eng.memory.state_bytes
        eng.free(st)
        eng.close()
    return held


def test_int8_state_is_about_half_of_bf16(tmp_path_factory):
    # tiny rows: bf16 64 bytes, int8 32 + 2 scales = 40
    held = held_state(synth_tiny(tmp_path_factory, "qwen3_moe"), ("bf16", "int8"), 300)
    assert held["bf16"] / 2 < held["int8"] < 0.7 * held["bf16"]
