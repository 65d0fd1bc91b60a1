"""HeapTrim gives freed heap pages back to the kernel (the RSS a batch job's steps left in glibc's arenas)."""
import json
import subprocess
import sys

import pytest

from moestream.engine import allocator as heap

pytestmark = pytest.mark.skipif(not heap.trim_available(), reason="libc has no malloc_trim")

# In a fresh interpreter, so that the heap's layout is this script's alone: 75 MB in chunks below the mmap
# threshold (heap, not mappings), touched, then all freed but the last (it pins the heap's top, so free() alone
# cannot shrink the heap); RSS before and after a step's trim.
_SCRIPT = """
import ctypes, ctypes.util, json, sys
from moestream.cgroup import rss_now
from moestream.engine import allocator as heap
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, n = 64 << 10, 1200
blocks = [libc.malloc(size) for _ in range(n + 1)]
for b in blocks:
    ctypes.memset(b, 1, size)
for b in blocks[:-1]:
    libc.free(b)
before = rss_now()
trim = heap.HeapTrim(every_s=0.0 if sys.argv[1] == "trim" else 3600.0)
trim.after_step()
print(json.dumps({"before": before, "after": rss_now(), "calls": trim.calls}))
"""


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_freed_heap_below_a_live_block_goes_back_after_a_step():
    kept = _run("none")  # no trim due yet: the freed 75 MB stay resident
    assert kept["calls"] == 0 and kept["before"] - kept["after"] < 10 << 20, kept
    got = _run("trim")
    assert got["calls"] == 1 and got["before"] - got["after"] > 50 << 20, got


def test_trims_at_most_once_per_interval():
    trim = heap.HeapTrim(every_s=3600.0)
    for _ in range(5):
        trim.after_step()
    assert trim.calls == 0
    trim.last -= 3601
    trim.after_step()
    trim.after_step()
    assert trim.calls == 1
