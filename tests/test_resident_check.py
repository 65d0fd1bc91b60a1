"""Resident memory outside the accountant's books is booked after a step and before the next
(engine/allocator.ResidentCheck), so the expert cache gives its room up: what the freed objects of a batch job's
finished sequences left resident (a 1,024-request job ended 25 MiB over its RSS bound, docs/memory.md)."""
import mmap

import pytest

from conftest import synth_tiny
from moestream import Engine
from moestream.engine.allocator import HeapTrim, anon_rss
from moestream.engine.engine import plan
from moestream.memory.accountant import MemoryAccountant

MiB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth_tiny(tmp_path_factory, "qwen3_moe")


def test_unbooked_memory_gives_way_to_state_and_keeps_expert_room():
    m = MemoryAccountant(100 * MiB)
    m.dense_bytes = 10 * MiB
    m.set_unbooked(200 * MiB, keep=20 * MiB)  # more than there is: all but the kept expert room
    assert m.unbooked_bytes == 70 * MiB and m.cache_capacity() == 20 * MiB and m.resident() == 80 * MiB
    m.grow_state(50 * MiB)  # state never fails for it: unbooked gives its room back
    assert m.state_bytes == 50 * MiB and m.unbooked_bytes == 20 * MiB and m.cache_capacity() == 20 * MiB
    m.release_state(50 * MiB)
    m.set_unbooked(23 * MiB, grow_step=4 * MiB, shrink_step=8 * MiB, keep=20 * MiB)  # small swings: no change
    assert m.unbooked_bytes == 20 * MiB
    m.set_unbooked(11 * MiB, grow_step=4 * MiB, shrink_step=8 * MiB, keep=20 * MiB)
    assert m.unbooked_bytes == 11 * MiB
    unlimited = MemoryAccountant(None)
    unlimited.set_unbooked(50 * MiB)
    assert unlimited.unbooked_bytes == 0


def _watched(tiny):
    """An engine with 96 MiB of expert room that measures its RSS (watch_resident), and a sequence two steps in."""
    p = plan(tiny)
    eng = Engine.open(tiny, ram_budget=p.dense_bytes + p.scratch_bytes + 96 * MiB)
    st = eng.new_sequence()
    eng.step([(st, [1, 2, 3, 4])])
    # settle the heap first: in a long test session, free heap that the steps' own trims return would offset the
    # held bytes below (RSS really did shrink by it), and the figure would depend on the tests run before
    HeapTrim(every_s=0).after_step()
    eng.watch_resident(keep=p.max_expert_bytes)
    eng.step([(st, [5])])
    return eng, st


@pytest.mark.skipif(anon_rss() == 0, reason="no /proc/self/statm")
def test_resident_memory_outside_the_books_displaces_experts(tiny):
    eng, st = _watched(tiny)
    try:
        room = eng.memory.cache_capacity()
        # a mapping of its own: a bytes object this size can be carved from a free hole that earlier tests left in
        # the heap, and after `del` its pages stay resident until the next trim (measured in the full suite)
        held = mmap.mmap(-1, 48 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for page in range(0, 48 * MiB, mmap.PAGESIZE):
            held[page] = 1  # touched, resident, on nobody's books
        eng.step([(st, [6])])
        assert eng.memory.unbooked_bytes >= 40 * MiB
        assert eng.memory.cache_capacity() <= room - 40 * MiB
        assert eng.memory.resident() <= eng.memory.budget
        assert eng.runner.cache.resident_bytes <= eng.memory.cache_capacity()
        held.close()  # unmapped: the room goes back to the experts, 8 MiB a step (the step's layer ends held it too)
        for t in range(7, 15):
            eng.step([(st, [t])])
        assert eng.memory.unbooked_bytes < 16 * MiB
    finally:
        eng.close()


@pytest.mark.skipif(anon_rss() == 0, reason="no /proc/self/statm")
def test_memory_held_between_steps_is_booked_before_the_next_step_reads(tiny):
    """Sequences freed between steps give their state's books back at once, and those books could cover more than
    RSS held; the engine measures again before a step, so its expert reads never fill room that RSS beyond the books
    already takes (the 1,024-request job's wave ending at once went 62 MB over its bound when only the end of a
    step was measured)."""
    eng, st = _watched(tiny)
    try:
        seen = []
        forward = eng.model.forward

        def spy(*args, **kwargs):  # the books as the step's layers start reading experts
            seen.append((eng.memory.unbooked_bytes, eng.memory.cache_capacity()))
            return forward(*args, **kwargs)

        eng.model.forward = spy
        room = eng.memory.cache_capacity()
        held = mmap.mmap(-1, 48 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for page in range(0, 48 * MiB, mmap.PAGESIZE):
            held[page] = 1  # between steps, as a finished sequence's freed books would leave it
        eng.step([(st, [6])])
        unbooked, capacity = seen[-1]
        assert unbooked >= 40 * MiB and capacity <= room - 40 * MiB
        held.close()
    finally:
        eng.close()


@pytest.mark.skipif(anon_rss() == 0, reason="no /proc/self/statm")
def test_memory_a_steps_layers_held_is_booked_for_the_next_steps_and_fades(tiny):
    """A step on the step heap keeps its freed temporaries until it ends, so RSS at its layer ends can stand well
    beyond what its end shows (the 1,024-request fp32 batch-invariant job's fragmented arena: 105 MiB at a step's
    peak over its end, 40-138 MB past the job's RSS bound). The engine notes RSS beyond the books after each layer
    and books it for the next steps, fading once they hold less."""
    eng, st = _watched(tiny)
    try:
        room = eng.memory.cache_capacity()
        forward = eng.model.forward

        def held_through_the_layers(*args, **kwargs):
            held = mmap.mmap(-1, 48 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for page in range(0, 48 * MiB, mmap.PAGESIZE):
                held[page] = 1  # resident through every layer end of this step, gone before the step ends
            try:
                return forward(*args, **kwargs)
            finally:
                held.close()

        eng.model.forward = held_through_the_layers
        eng.step([(st, [6])])
        eng.model.forward = forward
        assert anon_rss() - eng._resident.base - eng._resident.books() < 16 * MiB  # the step's end shows none of it
        assert eng.memory.unbooked_bytes >= 40 * MiB and eng.memory.cache_capacity() <= room - 40 * MiB
        assert eng.runner.cache.resident_bytes <= eng.memory.cache_capacity()
        eng.step([(st, [7])])  # the next step is measured with it still booked
        assert eng.memory.unbooked_bytes >= 32 * MiB
        for t in range(8, 16):  # steps that hold none of it: it fades
            eng.step([(st, [t])])
        assert eng.memory.unbooked_bytes < 16 * MiB
    finally:
        eng.close()
