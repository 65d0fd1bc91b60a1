"""HeapTrim gives freed heap pages back to the kernel (the RSS a batch job's steps left in glibc's arenas)."""
import ctypes
import ctypes.util

import pytest

from moestream.cgroup import rss_now
from moestream.memory import heap

pytestmark = pytest.mark.skipif(not heap.available(), reason="libc has no malloc_trim")


def test_freed_heap_below_a_live_block_goes_back_after_a_step():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 64 << 10, 1200  # 75 MB in chunks below the mmap threshold: heap, not mappings
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # touched: resident
    keep = libc.malloc(size)  # a live block above them, so the heap top cannot simply shrink
    for b in blocks:
        libc.free(b)
    before = rss_now()
    trim = heap.HeapTrim(every_s=0.0)
    trim.after_step()
    after = rss_now()
    libc.free(keep)
    assert trim.calls == 1
    assert before - after > 50 << 20, (before, after)


def test_trims_at_most_once_per_interval():
    trim = heap.HeapTrim(every_s=3600.0)
    for _ in range(5):
        trim.after_step()
    assert trim.calls == 0
    trim.last -= 3601
    trim.after_step()
    trim.after_step()
    assert trim.calls == 1
