"""KV / latent cache blocks live on slab slots whose pages go back to the kernel when a sequence ends
(memory/slabs.py): resident cache memory follows the live blocks, not the heap's high-water mark."""
from __future__ import annotations

import mmap

import pytest
import torch

from moestream.engine.engine import Engine
from moestream.memory.accountant import MemoryAccountant
from moestream.memory.slabs import SlabPool, blocks_out
from moestream.memory.state import BlockBuffer
from moestream.synth import synthesize

from conftest import prompt_ids


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_a_given_back_slot_loses_its_pages_and_is_reused():
    pool = SlabPool(32 << 10)
    t = pool.take(32 << 10)
    assert t.data_ptr() % mmap.PAGESIZE == 0
    t.fill_(7)
    pool.give(t)
    again = pool.take(32 << 10)  # the slot just given back (most recent first)
    assert again.data_ptr() == t.data_ptr() and int(again.sum()) == 0  # MADV_DONTNEED: the old pages are gone
    assert pool.slots_out == 1
    with pytest.raises(KeyError):
        pool.give(torch.empty(8, dtype=torch.uint8))  # not a slot of this pool


def test_released_caches_return_their_memory_despite_live_neighbours():
    """Blocks of 32 KiB (a bf16 KV block) interleaved with small long-lived allocations, as a batch job makes
    them: from the heap, the freed blocks stay resident behind the survivors; on slabs, RSS falls with them."""
    mem = MemoryAccountant(None)
    bufs, keep = [], []
    for _ in range(1600):  # 50 MiB of blocks
        b = BlockBuffer(mem, (4, 64), dtype=torch.bfloat16)
        b.push(torch.ones(1, 4, 64))
        b.blocks[0].fill_(1)  # touch every page of the block
        bufs.append(b)
        keep.append(torch.empty(200))  # a small survivor between blocks
    before = _rss()
    for b in bufs:
        b.release()
    freed = before - _rss()
    assert freed > 0.9 * 1600 * (32 << 10), f"only {freed / 2**20:.1f} MiB of 50 MiB of released blocks left RSS"
    assert mem.state_bytes == 0


def test_a_sliding_window_gives_dropped_blocks_back():
    mem = MemoryAccountant(None)
    out = blocks_out()
    buf = BlockBuffer(mem, (8,), window=20)
    for _ in range(600):
        buf.push(torch.ones(1, 8))
    assert blocks_out() - out == len(buf.blocks) <= 2
    buf.release()
    assert blocks_out() == out


def test_finished_sequences_hold_no_blocks(tmp_path):
    synthesize("qwen3_moe", tmp_path / "m", "tiny", progress=False)
    eng = Engine.open(tmp_path / "m", kv_dtype="bf16")
    out = blocks_out()
    states = [eng.new_sequence() for _ in range(5)]
    eng.step([(s, prompt_ids(200, 70 + 9 * i, seed=i)) for i, s in enumerate(states)])
    assert blocks_out() > out
    for s in states:
        eng.free(s)
    assert blocks_out() == out and eng.memory.state_bytes == 0
