"""A KV / latent cache is charged the pages its rows take, not whole blocks (memory/state.py BlockLayout): a block's
slab slot is resident only where rows were written, so the books follow what the kernel maps. Checked against the
kernel itself (mincore on each block's slot) for every storage dtype, through both write paths (BlockBuffer.push and
the engine's native decode / paged kernels writing in place after `reserve`), and for clones, growth forecasts and
the scheduler's profile of a fresh sequence."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import pytest
import torch

from conftest import prompt_ids, synth_tiny
from moestream.kernels import kvquant
from moestream.memory.accountant import MemoryAccountant
from moestream.memory.state import BLOCK_HOST_BYTES, BlockBuffer, kv_dtype
from moestream.server.prefix import StateProfile, buffers

PAGE = mmap.PAGESIZE
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_pages(block: torch.Tensor, nbytes: int) -> int:
    """Pages of the `nbytes` from `block`'s first byte (a page-aligned slab slot) that are resident now."""
    addr = block.data_ptr()
    assert addr % PAGE == 0
    pages = -(-nbytes // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert _LIBC.mincore(addr, pages * PAGE, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


def charged_pages(buf: BlockBuffer) -> int:
    """Pages the books say the buffer's blocks hold: its charge less the blocks' host bytes, in pages."""
    data = buf.nbytes - BLOCK_HOST_BYTES * len(buf.blocks)
    return -(-data // PAGE)


def slot_pages(buf: BlockBuffer) -> int:
    return sum(resident_pages(b, buf.block_bytes) for b in buf.blocks)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_a_buffer_is_charged_the_pages_its_rows_reach(dtype):
    mem = MemoryAccountant(None)
    buf = BlockBuffer(mem, (4, 64), dtype=kv_dtype(dtype))
    gen = torch.Generator().manual_seed(0)
    lay = buf.layout
    assert lay.charges[buf.block] == buf.block_charge  # a full block: its whole slot, as before
    length = 0
    for n in [1, 1, 7, 20, 1, buf.block - 30, 1, 3, buf.block + 5, 1]:
        grow = buf.growth(n)
        before = mem.state_bytes
        buf.push(torch.randn(n, 4, 64, generator=gen))
        length += n
        assert mem.state_bytes - before == grow and mem.state_bytes == buf.nbytes == lay.charge_at(length)
        # the books' pages are the pages the kernel mapped for the rows written
        assert slot_pages(buf) == charged_pages(buf) == -(-(buf.nbytes - BLOCK_HOST_BYTES * len(buf.blocks)) // PAGE)
    # a block of rows is charged no more than a whole block, and a partly written one less (whole pages per row
    # region: fp32 rows of 1 KiB fill a page every 4 rows; an int8 block's scales and first values share one)
    assert lay.charge_at(buf.block) == buf.block_charge and lay.charge_at(1) < buf.block_charge
    assert lay.charges[1] == BLOCK_HOST_BYTES + PAGE  # one row: its bytes (and its scales) in the first page
    copy = buf.clone(length - 10)
    assert copy.nbytes == buf.clone_bytes(length - 10) == lay.charge_at(length - 10)
    assert slot_pages(copy) == charged_pages(copy)  # the copy maps its rows' pages only
    assert torch.equal(copy.gather(), buf.gather()[:length - 10])
    mem.grow_state(copy.nbytes, "clone")
    copy.release()
    buf.release()
    assert mem.state_bytes == 0


def test_rows_free_counts_appends_before_the_next_page():
    mem = MemoryAccountant(None)
    buf = BlockBuffer(mem, (4, 64), dtype=kvquant.INT4)  # 144-byte rows: 142 a block of 5 pages
    lay = buf.layout
    buf.push(torch.randn(64, 4, 64))
    charged = mem.state_bytes
    free = lay.rows_free(64)
    assert free > 0 and buf.growth(free) == 0 and buf.growth(free + 1) > 0
    buf.push(torch.randn(free, 4, 64))
    assert mem.state_bytes == charged
    buf.push(torch.randn(1, 4, 64))
    assert mem.state_bytes == charged + PAGE
    buf.release()


@pytest.mark.parametrize("dtype", ["int4", "int8", "fp32"])
def test_engine_caches_written_in_place_are_charged_their_pages(tmp_path_factory, dtype):
    """Prefill, a batch decode step (the paged kernel appends in place) and one-sequence decode steps (the native
    decode layer): every buffer's slots hold exactly the pages its charge counts, and a fresh sequence's profile
    forecasts the charge its prompt makes."""
    from moestream import Engine

    eng = Engine.open(synth_tiny(tmp_path_factory, "qwen3_moe"), threads=1, kv_dtype=dtype)
    prof = StateProfile()
    states = [eng.new_sequence() for _ in range(3)]
    for st, n in zip(states, (5, 29, 70)):
        fresh = prof.growth(st, n) if prof.known else None
        before = eng.memory.state_bytes
        eng.prefill(st, prompt_ids(eng.vocab_size, n))
        prof.learn(st)
        if fresh is not None:  # the profile learned from the first forecasts the others' prompts
            assert fresh == eng.memory.state_bytes - before
    for _ in range(6):
        eng.step([(st, [7]) for st in states])  # the batched path
    for _ in range(3):
        eng.step([(states[0], [5])])  # one sequence
    for st in states:
        for buf in buffers(st):
            assert slot_pages(buf) == charged_pages(buf), (buf.length, buf.block)
    assert eng.memory.state_bytes == sum(b.nbytes for st in states for b in buffers(st))
    for st in states:
        eng.free(st)
    assert eng.memory.state_bytes == 0
