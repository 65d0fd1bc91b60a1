"""Weight buffers on transparent huge pages (weights/pages.py): a buffer of 2 MiB or more is a mapping rounded up to
2 MiB whose whole 2 MiB stretches are advised onto huge pages and whose tail is not; what becomes resident is the
bytes asked for, never the rounded-up tail; the reader's pool (plain 4 KiB mappings) recycles and counts buffers by
the bytes asked for; MOESTREAM_HUGEPAGES=0 gives plain mappings of the exact size."""
from __future__ import annotations

import ctypes
import mmap

import pytest

from conftest import smaps_mappings
from moestream.experts.reader import BufferPool
from moestream.weights import pages

MiB = 1 << 20


def _vmas(buf) -> list[dict]:
    """/proc/self/smaps entries (start, end, fields) of the mappings inside buf's address range."""
    lo = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    hi = lo + len(buf)
    return [m for m in smaps_mappings() if lo <= m["start"] and m["end"] <= hi]


@pytest.mark.skipif(not pages.enabled(), reason="no transparent huge pages here")
def test_a_large_buffer_is_rounded_advised_and_only_its_bytes_resident():
    want = 5 * MiB + 12345
    buf = pages.anon_buffer(want)
    assert isinstance(buf, mmap.mmap) and len(buf) == 6 * MiB
    buf[:want] = b"\x01" * want  # the whole buffer written, as a read fills it
    vmas = _vmas(buf)
    advised = [v for v in vmas if "hg" in v.get("flags", [])]
    refused = [v for v in vmas if "nh" in v.get("flags", [])]
    assert sum(v["end"] - v["start"] for v in advised) == 4 * MiB  # the two whole 2 MiB stretches
    assert sum(v["end"] - v["start"] for v in refused) == 2 * MiB  # the partial one and the untouched tail
    rss = sum(v.get("Rss", 0) for v in vmas)
    assert want <= rss <= -(-want // mmap.PAGESIZE) * mmap.PAGESIZE  # the tail past `want` never resident


def test_off_by_environment_and_for_small_buffers(monkeypatch):
    small = pages.anon_buffer(MiB + 1)
    assert len(small) == MiB + 1
    monkeypatch.setenv("MOESTREAM_HUGEPAGES", "0")
    assert not pages.enabled()
    big = pages.anon_buffer(3 * MiB + 7)
    assert len(big) == 3 * MiB + 7
    assert isinstance(pages.weight_bytes(3 * MiB), bytearray)


def test_the_pool_recycles_and_counts_by_the_bytes_asked_for():
    pool = BufferPool()
    want = 3 * MiB + 4096
    a = pool.take(want)
    assert len(a) == want  # a plain mapping (no huge-page fault on a cold step's read)
    pool.give(a)
    assert pool.idle_bytes == want and pool.mapped_bytes == want
    assert pool.take(want) is a  # the same buffer back, found under the size asked for
    assert pool.idle_bytes == 0
    pool.give(a)
    pool.trim(0)
    assert pool.idle_bytes == 0


def test_a_dense_weight_buffer_is_exactly_its_bytes():
    got = pages.weight_bytes(2 * MiB + 10)
    assert len(got) == 2 * MiB + 10
    got[-1] = 7
    assert got[-1] == 7
