"""A step on the step heap in an engine no scheduler watches (engine/allocator.StepRoom): anonymous RSS that a
step's layers grow beyond the books (and beyond the process's own memory at open) is booked as unbooked memory after
each layer, so the expert cache makes room for it, and given back when the step ends; one-row steps (off the step
heap) and engines without a budget book nothing."""
import json
import subprocess
import sys

import pytest

from conftest import synth_tiny
from moestream.engine import allocator

pytestmark = pytest.mark.skipif(not allocator.trim_available() or not sys.platform.startswith("linux"),
                                reason="glibc's mallopt / malloc_trim and /proc only")

MiB = 1 << 20

# In a fresh interpreter (process-wide malloc settings and RSS are this script's alone): after the first layer of
# a step, 24 MiB of touched memory the books do not know of (as a step heap's freed holes are), kept to the step's
# end; the unbooked bytes seen after each layer, the books' peak against the budget, and what is booked after.
_SCRIPT = """
import json, sys
import moestream
from moestream import Engine
from moestream.engine import allocator

path, budget, rows = sys.argv[1], (int(sys.argv[2]) if sys.argv[2] != "none" else None), int(sys.argv[3])
eng = Engine.open(path, ram_budget=budget)
seen, hog, armed = [], [], []
inner = allocator.StepRoom.layer_done

def layer_done(self):
    if armed and not hog:
        hog.append(bytearray(b"\\x01") * (24 << 20))
    inner(self)
    if armed:
        seen.append(self.memory.unbooked_bytes)

allocator.StepRoom.layer_done = layer_done
st = eng.new_sequence()
eng.prefill(st, list(range(3, 3 + 40)))  # a first step, so the cache holds what it can
armed.append(True)
eng.step([(st, list(range(5, 5 + rows)))])
print(json.dumps({"seen": seen, "after": eng.memory.unbooked_bytes, "peak": eng.memory.peak,
                  "budget": budget, "limited": eng.memory.limited}))
"""


def _run(path, budget, rows):
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), str(budget), str(rows)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth_tiny(tmp_path_factory, "qwen3_moe", "step_room")


def test_rss_beyond_the_books_in_a_step_heap_step_is_booked_then_given_back(tiny):
    got = _run(tiny, 64 * MiB, 32)  # 32 rows: on the step heap
    assert len(got["seen"]) >= 2 and min(got["seen"]) >= 20 * MiB, got["seen"]  # booked from the first layer on
    assert max(got["seen"]) <= 48 * MiB, got["seen"]
    assert got["peak"] <= got["budget"]
    assert got["after"] == 0  # the step's end gives it back


def test_one_row_steps_and_unlimited_engines_book_nothing(tiny):
    assert _run(tiny, 64 * MiB, 1)["seen"] == []  # off the step heap: no StepRoom
    got = _run(tiny, "none", 32)
    assert not got["limited"] and got["seen"] == [] and got["after"] == 0
