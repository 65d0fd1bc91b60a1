"""A step of many rows keeps its freed temporaries on the heap for its later ones (engine/allocator.StepHeap): each
2 MiB block of such a step reuses pages instead of faulting in a fresh mapping, and the pages go back to the
kernel when the step ends."""
import json
import subprocess
import sys

import pytest

from moestream.engine import allocator as heap

pytestmark = pytest.mark.skipif(not heap.trim_available() or not sys.platform.startswith("linux"),
                                reason="glibc's mallopt / malloc_trim only")

# In a fresh interpreter (the process-wide malloc settings are this script's alone): 40 rounds of malloc + touch +
# free of a 2 MiB block (a 512-row activation of a 1024-wide model), counting minor page faults, outside a step and
# inside one of 64 rows; RSS before the step, at its end and after it.
_SCRIPT = """
import ctypes, ctypes.util, json, resource
from moestream.cgroup import rss_now
from moestream.engine import allocator as heap
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
assert heap.return_freed_memory()
SIZE, ROUNDS = 2 << 20, 40

def rounds(keep=None):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(ROUNDS):
        b = libc.malloc(SIZE)
        ctypes.memset(b, 1, SIZE)
        libc.free(b)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

out = {"outside": rounds()}
small = heap.StepHeap.enter(heap.STEP_HEAP_ROWS - 1)
with small:
    out["small_step"] = rounds()
before = rss_now()
with heap.StepHeap.enter(64):
    out["inside"] = rounds()
    held = [libc.malloc(SIZE) for _ in range(30)]  # 60 MB of live temporaries, touched, freed before the end
    for b in held:
        ctypes.memset(b, 1, SIZE)
    for b in held:
        libc.free(b)
    with heap.StepHeap.enter(64):  # a nested step (another engine's, on another thread) keeps the heap on
        pass
    out["depth_after_nested"] = heap.StepHeap.depth
    out["in_step_rss"] = rss_now() - before
out["after_rss"] = rss_now() - before
out["after"] = rounds()
out.update(trims=heap.StepHeap.trims, small_active=small.active, depth=heap.StepHeap.depth)
print(json.dumps(out))
"""


def test_step_reuses_heap_pages_and_gives_them_back():
    got = json.loads(subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                                    check=True).stdout)
    pages = (2 << 20) // 4096
    # outside a step every 2 MiB block is its own mapping: all its pages fault, every round
    assert got["outside"] >= 40 * pages * 0.9, got
    assert got["after"] >= 40 * pages * 0.9, got  # the fixed setting is back after the step
    assert not got["small_active"] and got["small_step"] >= 40 * pages * 0.9, got
    # inside, the freed block's pages are reused: about one block's faults in all
    assert got["inside"] <= 3 * pages, got
    assert got["depth_after_nested"] == 1 and got["depth"] == 0 and got["trims"] == 1, got
    # the step held the freed 60 MB while it ran, and gave them back when it ended
    assert got["in_step_rss"] > 40 << 20, got
    assert got["after_rss"] < 10 << 20, got


def test_engine_steps_use_the_step_heap_unless_a_scheduler_holds_rss_beside_a_prompt(tmp_path_factory):
    from conftest import expert_budget, synth_tiny
    from moestream import Engine

    tiny = synth_tiny(tmp_path_factory, "qwen3_moe")
    eng = Engine.open(tiny, ram_budget=expert_budget(tiny, 1.0))
    try:
        st = eng.new_sequence()
        t0 = heap.StepHeap.trims
        eng.step([(st, list(range(1, heap.STEP_HEAP_ROWS)))])  # too few rows
        assert heap.StepHeap.trims == t0
        eng.step([(st, list(range(1, heap.STEP_HEAP_ROWS + 1)))])
        assert heap.StepHeap.trims == t0 + (1 if heap.return_freed_memory() else 0)
        assert heap.StepHeap.depth == 0
        l0 = heap.StepHeap.layer_trims
        assert eng.model.after_layer is None
        eng.watch_resident()
        eng.step([(st, list(range(1, 33)))])  # a scheduler's step with a prompt chunk: the fixed setting stays
        assert heap.StepHeap.trims == t0 + (1 if heap.return_freed_memory() else 0)
        # ... and the heap's free pages go back after each of its layers
        layers = len(eng.model.layers) if heap.return_freed_memory() else 0
        assert heap.StepHeap.layer_trims == l0 + layers and eng.model.after_layer is None
        eng.step([(st, list(range(1, heap.STEP_HEAP_ROWS)))])  # too few rows to trim
        assert heap.StepHeap.layer_trims == l0 + layers
        more = [eng.new_sequence() for _ in range(heap.STEP_HEAP_ROWS)]
        for s in more:
            eng.step([(s, [5, 6])])
        eng.step([(s, [7]) for s in more] + [(st, [8, 9])])  # decoding beside a prompt chunk: fixed setting
        assert heap.StepHeap.trims == t0 + (1 if heap.return_freed_memory() else 0)
        assert heap.StepHeap.layer_trims == l0 + 2 * layers
        eng.step([(s, [7]) for s in more])  # a scheduler's decode step of STEP_HEAP_ROWS sequences: the step heap
        assert heap.StepHeap.trims == t0 + (2 if heap.return_freed_memory() else 0)
        assert heap.StepHeap.layer_trims == l0 + 2 * layers
    finally:
        eng.close()


def test_batch_invariant_decode_steps_under_a_scheduler_keep_the_fixed_setting(tmp_path_factory):
    """Under batch invariance a scheduler's decode step trims the heap after each layer instead of keeping its
    freed temporaries (the step heap's arena grew step after step in the fp32 batch job, past its RSS bound);
    outside a scheduler it still runs on the step heap."""
    from conftest import expert_budget, synth_tiny
    from moestream import Engine

    tiny = synth_tiny(tmp_path_factory, "qwen3_moe")
    eng = Engine.open(tiny, ram_budget=expert_budget(tiny, 1.0), batch_invariant=True)
    try:
        seqs = [eng.new_sequence() for _ in range(heap.STEP_HEAP_ROWS)]
        for s in seqs:
            eng.step([(s, [5, 6])])
        t0, l0 = heap.StepHeap.trims, heap.StepHeap.layer_trims
        eng.step([(s, [7]) for s in seqs])  # no scheduler: the step heap
        assert heap.StepHeap.trims == t0 + (1 if heap.return_freed_memory() else 0)
        assert heap.StepHeap.layer_trims == l0
        eng.watch_resident()
        eng.step([(s, [8]) for s in seqs])  # a scheduler's decode step: the fixed setting, a trim after each layer
        layers = len(eng.model.layers) if heap.return_freed_memory() else 0
        assert heap.StepHeap.trims == t0 + (1 if heap.return_freed_memory() else 0)
        assert heap.StepHeap.layer_trims == l0 + layers and heap.StepHeap.depth == 0
    finally:
        eng.close()
