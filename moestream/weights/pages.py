"""Anonymous buffers for weights. Resident dense matrices (loaded once, streamed by every step), and the buffers
streamed dense weights are read into (a head's two slab buffers, the layers' two slots: made once, kept,
engine/residency.py): each whole 2 MiB stretch of the bytes asked for on a transparent huge page where the kernel
offers them (THP mode "madvise" or "always"), the rest on 4 KiB pages, so that resident memory is still the bytes
asked for, which is what the budget counts. The reader's expert
buffers (mapped while a cold step waits on them) stay plain 4 KiB mappings (experts/reader.py): fresh huge pages
fault in slowly on this VM, and expert buffers come and go.

Why: a decode step streams every dense matrix from RAM once, and on 4 KiB pages each page of the stream costs a TLB
miss and a page walk. A 512 MiB bf16 matrix-vector product on this machine's two cores ran 25.4 against 22.5 GB/s
(one thread 21.0 against 19.4) on huge pages; a warm decode of the peer checkpoint 1.04x with its dense weights so.
Expert buffers on huge pages gained a warm decode 1.01x but cost a cold 16-token prefill a third of its speed: each
fresh buffer's huge-page fault may stall on compaction while the step waits on its read (docs/performance.md).

How: the mapping's length is rounded up to a multiple of 2 MiB, which makes Linux place it on a 2 MiB boundary
(anonymous mappings of PMD-multiple length are aligned); MADV_HUGEPAGE covers the whole 2 MiB stretches within the
bytes asked for, MADV_NOHUGEPAGE the rest, whose part past the bytes asked for is never touched, so it never
becomes resident (khugepaged does not fill it either). Where the kernel does not align the mapping, huge pages
cover only the aligned stretches inside the advised range, never more than it. MOESTREAM_HUGEPAGES=0 turns this
off (plain mappings of the exact size)."""
from __future__ import annotations

import mmap
import os
from pathlib import Path

HUGE = 2 << 20
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ok: bool | None = None


def enabled() -> bool:
    """Whether buffers of 2 MiB or more get huge pages: MOESTREAM_HUGEPAGES is not 0, the kernel's THP mode is
    "always" or "madvise", and Python's mmap can advise them. Asked once (the environment variable every time)."""
    global _ok
    if os.environ.get("MOESTREAM_HUGEPAGES", "1") == "0":
        return False
    if _ok is None:
        try:
            mode = _THP.read_text()
        except OSError:
            mode = ""
        _ok = ("[always]" in mode or "[madvise]" in mode) and hasattr(mmap, "MADV_HUGEPAGE") \
            and hasattr(mmap, "MADV_NOHUGEPAGE")
    return _ok


def huge_bytes(nbytes: int) -> int:
    """Bytes of a weight of `nbytes` that `anon_buffer` advises onto huge pages where `enabled()`: its whole 2 MiB
    stretches (none below 2 MiB)."""
    return nbytes // HUGE * HUGE


def anon_buffer(nbytes: int) -> mmap.mmap:
    """A zero-filled private anonymous mapping of at least `nbytes` (page-aligned). When `enabled()` and nbytes >=
    2 MiB: rounded up to 2 MiB, its whole 2 MiB stretches of the first `nbytes` advised onto huge pages and the rest
    not; else exactly `nbytes` (at least one byte)."""
    if nbytes < HUGE or not enabled():
        return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    length = -(-nbytes // HUGE) * HUGE
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = huge_bytes(nbytes)
    buf.madvise(mmap.MADV_HUGEPAGE, 0, whole)
    if length > whole:
        buf.madvise(mmap.MADV_NOHUGEPAGE, whole, length - whole)
    return buf


def weight_bytes(nbytes: int) -> memoryview | bytearray:
    """Writable memory for a weight of `nbytes` that stays resident: a view of exactly `nbytes` over an
    `anon_buffer` (huge pages for its whole 2 MiB stretches) when that applies, else a bytearray."""
    if nbytes < HUGE or not enabled():
        return bytearray(nbytes)
    return memoryview(anon_buffer(nbytes))[:nbytes]
