"""Dense-weight residency: which dense weights stay resident under the RAM budget, and streaming the others.

Owns `plan_residency` (from a `ModelPlan` and a budget: which decoder layers keep their large matrices resident,
whether the embedding is read row by row from disk and the lm_head in slabs, the stream buffers that costs, what
is left for the expert cache; BudgetError naming the numbers when even streaming everything cannot fit) and
`DenseStreamer`, which carries that plan out: it hands the model tensors over places in two slots kept for the
engine's life (the streamed layers take them in turn), filled just before their layer runs while reader threads
fetch the next streamed layer into the other slot (where slots cannot be used: placeholder tensors whose storage
is filled before their layer runs and emptied right after), and reads a streamed head slab by slab.
Small tensors (norms, biases, routers, vectors) are always resident: they are used every token and cost little.
"""
from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import re
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable
from pathlib import Path

import torch

from moestream.config import format_bytes
from moestream.errors import BudgetError, CheckpointError
from moestream.experts.reader import group_extents
from moestream.kernels import b12
from moestream.kernels.b12 import B12Weight
from moestream.models.blocks import UPCAST_CHUNK_BYTES, linear
from moestream.weights import pages
from moestream.weights.index import ALIGN, CheckpointIndex, TensorInfo, pread_fill, read_into, read_range

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
HEAD_SLAB_BYTES = 64 << 20  # one lm_head slab read while the previous one computes (two are in RAM at once)
EMBED_ROWS_BYTES = 4 << 20  # the most embedding rows read in one go when the table is not resident
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROUTERS = (".gate.weight", ".router.weight")  # run by the expert lookahead one layer early: never streamed
GAP_BYTES = 256 << 10  # tensors of a layer closer than this in a shard are read in one call (the gap is discarded)
READ_BYTES = 4 << 20  # one read in flight on a reader thread
READ_THREADS = 4


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def streamable(name: str, info: TensorInfo) -> bool:
    """A layer tensor that may stream: a real matrix (both sides > 1) that is not a router."""
    return len(info.shape) == 2 and min(info.shape) > 1 and not name.endswith(_ROUTERS)


# products of 16+ tokens by a matrix of under 12 rows sum in another order than inside a larger one
HEAD_SLAB_MIN_ROWS = 16


def head_slabs(rows: int, cols: int, row_bytes: int) -> list[tuple[int, int]]:
    """(start, count) slabs of lm_head rows. Each slab is a whole number of `blocks.linear`'s upcast chunks and
    the last one is larger than one chunk, so a slab's `linear` runs the very chunks the resident head would; nor is
    the last one under HEAD_SLAB_MIN_ROWS rows (a matrix of fewer rows takes another native path for many tokens)."""
    chunk = max(1, UPCAST_CHUNK_BYTES // (4 * cols))
    per = max(1, HEAD_SLAB_BYTES // max(1, row_bytes))
    if per >= chunk:
        per -= per % chunk
    slabs = [(s, min(per, rows - s)) for s in range(0, rows, per)]
    if len(slabs) > 1 and (rows > chunk and slabs[-1][1] <= chunk or slabs[-1][1] < HEAD_SLAB_MIN_ROWS):
        (s, n), (_, m) = slabs[-2], slabs.pop()
        slabs[-1] = (s, n + m)
    return slabs


@dataclass
class LayerResidency:
    layer: int
    bytes: int  # its streamable matrices (the layer's small tensors are counted in pinned_bytes)
    streamed: bool


@dataclass
class ResidencyPlan:
    """What stays resident and what streams under one budget (printed by `moestream info --ram-budget`)."""

    ram_budget: int | None
    dense_bytes: int  # every dense tensor of the checkpoint
    pinned_bytes: int  # norms, biases, routers, vectors and other small tensors: always resident
    unread_bytes: int  # layers past the model's last (multi-token prediction): never loaded
    embed_bytes: int  # the input embedding table (0 when there is none by that name)
    head_bytes: int  # the lm_head (0 when tied to the embedding: the table serves both)
    tied: bool
    embed_streamed: bool  # rows of the step's tokens are read from disk
    head_streamed: bool  # read in slabs, the next slab in flight while one computes
    layers: list[LayerResidency]
    scratch_bytes: int
    min_cache_bytes: int  # the expert cache the plan keeps at least (top_k experts, or one if tight)
    state_room_bytes: int  # kept for KV caches and recurrent state on top of that (they grow into the cache)
    head_slab_bytes: int = 0  # the largest lm_head slab (two are in RAM while streaming)
    head_resident_rows: int = 0  # of a streamed head, rows [0, n) kept resident (read once; the rest stream)
    head_resident_bytes: int = 0
    head_stream_bytes: int = 0  # what a step reads of a streamed head: its slabs after the resident rows
    embed_rows_bytes: int = 0  # the row buffer of a streamed embedding
    layer_buffer_bytes: int = 0  # two of the largest streamed layers: the current one and the next in flight
    stream_buffer_bytes: int = 0  # every stream buffer together (reserved out of the budget)
    resident_dense_bytes: int = 0
    streamed_bytes_per_step: int = 0  # dense bytes read from disk each forward step
    cache_bytes: int | None = None  # what the budget leaves for experts (KV and state grow into it)
    min_ram_budget: int = 0  # the smallest budget any plan fits (every layer streamed, one expert cached)
    all_resident_budget: int = 0  # the smallest budget keeping every dense weight resident (top_k experts cached)

    @property
    def streamed_layers(self) -> list[int]:
        return [lr.layer for lr in self.layers if lr.streamed]

    @property
    def streams(self) -> bool:
        return self.embed_streamed or self.head_streamed or any(lr.streamed for lr in self.layers)

    def to_json(self) -> dict:
        out = asdict(self)
        out["layers"] = [[lr.layer, lr.bytes, lr.streamed] for lr in self.layers]
        out["streamed_layers"] = self.streamed_layers
        return out


@dataclass
class _Parts:
    """The dense tensors of a plan sorted into what the planner decides about."""

    pinned: int
    unread: int  # tensors of layers past the model's last (e.g. multi-token-prediction layers): never loaded
    embed: int
    head: int
    tied: bool
    layers: dict[int, int]  # layer -> streamable bytes
    head_slab: int
    embed_rows: int
    one_expert: int
    top_k_experts: int
    head_shape: tuple[int, int, int] | None = None  # (rows, cols, bytes a row) of the table serving as the head
    # the bytes of the head's first r rows (a coded head's from its base bytes and exception table); None where
    # they are not known (a coded head whose bytes cannot be read here), so no rows stay resident
    head_prefix: Callable[[int], int] | None = None
    # the bytes a step reads of a streamed head whose first r rows are resident (a coded head's slabs each carry
    # their own padded base bytes and table)
    head_read: Callable[[int], int] | None = None


def _parts(p) -> _Parts:
    index, prefix = p.store.index, p.family.prefix
    pinned, unread, embed, head, layers = 0, 0, 0, 0, {}
    head_info = None
    n_layers = getattr(p.config, "num_layers", None)
    for full in p.dense_names:
        name, info = full[len(prefix):], index[full]
        layer = layer_of(name)
        if layer is not None and n_layers is not None and layer >= n_layers:
            unread += info.nbytes
            continue
        if name == EMBED:
            embed = info.nbytes
        elif name == HEAD:
            head, head_info = info.nbytes, info
        elif layer is not None and streamable(name, info):
            layers[layer] = layers.get(layer, 0) + info.nbytes
        else:
            pinned += info.nbytes
        if layer is not None:
            layers.setdefault(layer, 0)
    tied = embed > 0 and (head == 0 or bool(getattr(p.config, "tie", False)))
    if tied:  # the table serves as the head (a stored lm_head, if any, is never read: left pinned, to be safe)
        pinned, head, head_info = pinned + head, 0, index[prefix + EMBED]
    head_slab, head_shape, first_rows, head_read = 0, None, None, None
    if head_info is not None and len(head_info.shape) == 2:
        rows, cols = head_info.shape
        row_bytes = head_info.nbytes // max(1, rows)
        slabs = head_slabs(rows, cols, row_bytes)
        head_slab = max(n for _, n in slabs) * row_bytes
        head_shape = (rows, cols, row_bytes)
        first_rows = lambda r: r * row_bytes  # noqa: E731
        head_read = lambda r: (rows - r) * row_bytes  # noqa: E731
        if head_info.codec is not None:
            coded = _coded_head(head_info)
            first_rows = None if coded is None else (lambda r: coded.nbytes(0, r))
            if coded is not None:  # its slabs' own sizes (rows stored whole make some larger than the mean)
                head_slab = max(coded.nbytes(s, n) for s, n in slabs)
                head_read = lambda r: sum(coded.nbytes(s, n) for s, n in slabs if s >= r)  # noqa: E731
    embed_info = index[prefix + EMBED] if embed else None
    row = embed_info.nbytes // max(1, embed_info.shape[0]) if embed_info is not None else 0
    embed_rows = min(embed, max(row, EMBED_ROWS_BYTES // max(1, row) * row))  # what DenseStreamer.embed reads at once
    k = max(1, min(p.layout.top_k, p.layout.num_experts))
    return _Parts(pinned, unread, embed, head, tied, dict(sorted(layers.items())), head_slab, embed_rows,
                  p.max_expert_bytes, k * p.max_expert_bytes, head_shape, first_rows, head_read)


_CODED_HEADS: dict[tuple, "_CodedRows"] = {}


def _coded_head(info: TensorInfo, strict: bool = False) -> "_CodedRows | None":
    """The coded head's rows (base bytes and exception table read once a process for a file as it is: its inode and
    modification time are in the key), None where its file cannot be read here (`strict`: the OSError)."""
    try:
        st = os.stat(info.file) if isinstance(info.file, Path) else None
        key = (str(info.file), info.offset, info.nbytes, st and (st.st_ino, st.st_mtime_ns, st.st_size))
        if key not in _CODED_HEADS:
            _CODED_HEADS[key] = _CodedRows(info)
    except OSError:
        if strict:
            raise
        return None
    return _CODED_HEADS[key]


# A streamed lm_head keeps its first rows resident out of what the expert cache would have beyond this many top_k
# experts' room (the current layer's and the next one's read ahead): every head byte is read every step, while a
# cached expert byte saves a read only when a step routes to it, so dense bytes are the better use of the RAM.
HEAD_ROWS_CACHE_KEEP = 2


def _head_rows(parts: _Parts, spare: int) -> int:
    """How many leading rows of a streamed head fit `spare` bytes: a slab boundary (head_slabs), so the resident
    part and the slabs after it run the chunks the whole head would; 0 for a coded head whose bytes cannot be read
    here (its rows' sizes are known only from them)."""
    if parts.head_shape is None or parts.head_prefix is None or spare <= 0:
        return 0
    rows, cols, row_bytes = parts.head_shape
    best = 0
    for start, n in head_slabs(rows, cols, row_bytes):
        if parts.head_prefix(start + n) > spare or start + n >= rows:
            break
        best = start + n
    return best


def _tables_ram(parts: _Parts, head_s: bool, embed_s: bool) -> int:
    """RAM the lm_head and the embedding hold: a streamed head its two slabs, a streamed embedding (or a tied table
    whose head streams) its row buffer, otherwise the tables themselves."""
    ram = 2 * parts.head_slab if head_s else (parts.embed if parts.tied else parts.head)
    if not parts.tied:
        ram += parts.embed_rows if embed_s else parts.embed
    elif head_s:
        ram += parts.embed_rows  # a tied table streamed serves the embedding by rows too
    return ram


def _choose(parts: _Parts, avail: int, cache: int, head_ok: bool, embed_ok: bool):
    """The plan streaming the fewest bytes per step that leaves `cache` for experts out of `avail` (budget less
    scratch and pinned); None when nothing fits. Returns (streamed layers, embed streamed, head streamed)."""
    best = None
    sizes = sorted({b for b in parts.layers.values() if b > 0})
    table = parts.head if not parts.tied else parts.embed
    for head_s in ([False, True] if head_ok else [False]):
        for embed_s in ([False, True] if embed_ok and not parts.tied else [False]):
            fixed = cache + _tables_ram(parts, head_s, embed_s)
            for cap in [0] + sizes:
                streamed = _stream_under(parts.layers, cap, avail - fixed)
                if streamed is None:
                    continue
                cost = sum(parts.layers[l] for l in streamed) + (table if head_s else 0)
                key = (cost, embed_s, len(streamed))
                if best is None or key < best[0]:
                    best = (key, streamed, embed_s or (parts.tied and head_s), head_s)
    return None if best is None else best[1:]


def _least_layer_bytes(layers: dict[int, int]) -> int:
    """The fewest bytes the layers can hold in RAM: for some cap, every layer up to it streams through a double
    buffer of the cap and the larger ones stay resident."""
    sizes = sorted({b for b in layers.values() if b > 0})
    return min([sum(layers.values())] + [sum(b for b in layers.values() if b > c) + 2 * c for c in sizes])


def _stream_under(layers: dict[int, int], cap: int, room: int) -> list[int] | None:
    """Layers to stream so that resident layers plus a double buffer of `cap` fit `room`, streaming only layers of
    at most `cap` bytes, the largest first, spread evenly over the stack within a size; None if impossible."""
    total = sum(layers.values())
    if cap == 0:
        return [] if total <= room else None
    deficit = total + 2 * cap - room
    if deficit <= 0:
        return None  # fits without streaming: the cap 0 candidate covers it
    chosen: list[int] = []
    for size in sorted({b for b in layers.values() if 0 < b <= cap}, reverse=True):
        group = [l for l, b in layers.items() if b == size]
        need = min(len(group), -(-deficit // size))
        chosen += [group[(i * len(group)) // need] for i in range(need)]  # every len/need-th layer
        deficit -= need * size
        if deficit <= 0:
            return sorted(chosen)
    return None


def plan_residency(p, budget: int | None, state_room: int = 0, head_rows: bool = True) -> ResidencyPlan:
    """Decide what stays resident under `budget` (None: everything), keeping `state_room` bytes for KV caches and
    recurrent state on top of the minimum expert cache (state grows into the cache's room). `head_rows`: a
    streamed head keeps leading rows resident out of the cache's room beyond HEAD_ROWS_CACHE_KEEP x top_k experts
    (off for many sequences without a state room of their own: their state grows into that room). BudgetError
    when nothing fits."""
    parts = _parts(p)
    table = parts.head if not parts.tied else parts.embed
    layer_total = sum(parts.layers.values())
    embed_own = parts.embed if not parts.tied else 0
    all_resident = (p.scratch_bytes + parts.pinned + layer_total + table + embed_own + parts.top_k_experts
                    + state_room)
    head_ok = table > 2 * parts.head_slab > 0
    embed_ok = parts.embed > parts.embed_rows
    least_tables = _tables_ram(parts, head_ok, True)  # embed_rows never exceeds the table
    floor = (p.scratch_bytes + parts.pinned + _least_layer_bytes(parts.layers) + parts.one_expert + state_room
             + least_tables)
    choice, cache_min = ([], False, False), parts.top_k_experts
    if budget is not None:
        avail = budget - p.scratch_bytes - parts.pinned
        choice = _choose(parts, avail, parts.top_k_experts + state_room, head_ok, embed_ok)
        if choice is None:
            cache_min = parts.one_expert
            choice = _choose(parts, avail, parts.one_expert + state_room, head_ok, embed_ok)
        if choice is None:
            raise BudgetError(_too_small(p, parts, budget, floor, least_tables, state_room))
    streamed, embed_s, head_s = choice
    layers = [LayerResidency(l, b, l in streamed) for l, b in parts.layers.items()]
    out = ResidencyPlan(budget, p.dense_bytes, parts.pinned, parts.unread, parts.embed, parts.head, parts.tied,
                        embed_s, head_s, layers, p.scratch_bytes, cache_min, state_room, min_ram_budget=floor,
                        all_resident_budget=all_resident)
    out.head_slab_bytes = parts.head_slab if head_s else 0
    out.embed_rows_bytes = parts.embed_rows if embed_s else 0
    out.layer_buffer_bytes = 2 * max((parts.layers[l] for l in streamed), default=0)
    out.stream_buffer_bytes = out.layer_buffer_bytes + 2 * out.head_slab_bytes + out.embed_rows_bytes
    out.resident_dense_bytes = (parts.pinned + sum(b for l, b in parts.layers.items() if l not in streamed)
                                + (0 if head_s else table) + (0 if embed_s or parts.tied else parts.embed))
    head_read = parts.head_read or (lambda r: table)  # (no 2-D head: no rows stay resident)
    out.head_stream_bytes = head_read(0) if head_s else 0
    if budget is not None:
        out.cache_bytes = budget - out.resident_dense_bytes - out.stream_buffer_bytes - p.scratch_bytes
        if head_s and head_rows:
            keep = max(cache_min, HEAD_ROWS_CACHE_KEEP * parts.top_k_experts) + state_room
            rows = _head_rows(parts, out.cache_bytes - keep)
            if rows:
                held = parts.head_prefix(rows)
                out.head_resident_rows, out.head_resident_bytes = rows, held
                out.head_stream_bytes = head_read(rows)
                out.resident_dense_bytes += held
                out.cache_bytes -= held
    out.streamed_bytes_per_step = sum(parts.layers[l] for l in streamed) + out.head_stream_bytes
    return out


def _too_small(p, parts: _Parts, budget: int, floor: int, table: int, state_room: int) -> str:
    biggest, layers = max(parts.layers.values(), default=0), _least_layer_bytes(parts.layers)
    return (f"--ram-budget {format_bytes(budget)} ({budget} bytes) is too small even with every dense layer "
            f"streamed: the dense weights are {format_bytes(p.dense_bytes)} ({p.dense_bytes} bytes); streaming "
            f"them still needs {format_bytes(floor)} ({floor} bytes) = small always-resident tensors "
            f"{format_bytes(parts.pinned)} + layers and their double buffer "
            f"{format_bytes(layers)} (the largest layer is {format_bytes(biggest)}) + embedding and lm_head or their "
            f"buffers {format_bytes(table)} + compute scratch {format_bytes(p.scratch_bytes)} + one expert "
            f"{format_bytes(parts.one_expert)}" + (f" + state room {format_bytes(state_room)}" if state_room else "")
            + f"; raise the budget to at least {floor} bytes")


# ---- streaming ----------------------------------------------------------------------------------------------
def direct_span(offset: int, nbytes: int, extra: int = 0) -> int:
    """Bytes `read_direct` needs for [offset, offset + nbytes) and `extra` bytes after it: the enclosing 4 KiB-aligned
    range, or up to the extra bytes' end if that is further."""
    first = offset // ALIGN * ALIGN
    return max(-(-(offset + nbytes - first) // ALIGN) * ALIGN, offset - first + nbytes + extra)


def read_direct(file, offset: int, nbytes: int, extra: int = 0, into: mmap.mmap | None = None
                ) -> tuple[mmap.mmap, int] | None:
    """[offset, offset + nbytes) of a local file by one O_DIRECT read of the enclosing 4 KiB-aligned range into
    `into` (a mapping of at least `direct_span` bytes, reused by the caller) or else fresh anonymous pages, with
    room for `extra` bytes after it: (the mapping, where the range starts in it). None where O_DIRECT is refused or
    the file is not local (the caller reads buffered)."""
    if not hasattr(os, "O_DIRECT") or not isinstance(file, Path):
        return None
    first = offset // ALIGN * ALIGN
    size = -(-(offset + nbytes - first) // ALIGN) * ALIGN
    span = direct_span(offset, nbytes, extra)
    if into is not None and len(into) < span:
        raise ValueError(f"internal: a direct read of {span} bytes into a buffer of {len(into)}")
    try:
        fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    try:
        buf = into if into is not None else mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            done, _ = pread_fill(fd, [memoryview(buf)[:size]], first)
        except OSError:
            return None
    finally:
        os.close(fd)
    if done < offset + nbytes - first:
        raise CheckpointError(f"{file}: unexpected end of file at byte {first + done}")
    return buf, offset - first


def _read_aligned(path: Path, offset: int, view: memoryview) -> None:
    """[offset, offset + len(view)) of a local file, offset, length and view 4 KiB-aligned, by O_DIRECT (a buffered
    read where the file refuses it); CheckpointError if the file ends first."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        read_into(path, offset, [view])
        return
    try:
        done, _ = pread_fill(fd, [view], offset)
    except OSError:  # (O_DIRECT refused at read time: the same bytes buffered)
        done = -1
    finally:
        os.close(fd)
    if done == -1:
        read_into(path, offset, [view])
    elif done < len(view):
        raise CheckpointError(f"{path}: unexpected end of file at byte {offset + done}")


def _buffer(storage) -> ctypes.Array:
    """A writable bytes view of a CPU storage (for positioned reads straight into it)."""
    return (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())


def _runs(items: list[tuple[torch.Tensor, TensorInfo]]) -> list[list[tuple[torch.Tensor, TensorInfo]]]:
    """Tensors grouped into runs: same shard, in offset order, gaps under GAP_BYTES."""
    groups = group_extents([(info.file, info.offset, info.nbytes) for _, info in items], GAP_BYTES)
    return [[items[i] for i in g] for g in groups]


def _pieces(offset: int, views: list[memoryview], size: int) -> list[tuple[int, list[memoryview]]]:
    """Consecutive byte views starting at `offset` cut into (offset, views) pieces of about `size` bytes."""
    out, cur, cur_off, cur_len = [], [], offset, 0
    for v in views:
        while len(v):
            take = min(len(v), size - cur_len)
            cur.append(v[:take])
            v, cur_len = v[take:], cur_len + take
            if cur_len == size:
                out.append((cur_off, cur))
                cur_off, cur, cur_len = cur_off + cur_len, [], 0
    if cur:
        out.append((cur_off, cur))
    return out


def _empty_placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` whose storage holds no bytes until its layer is read (pages are never touched)."""
    t = torch.empty(shape, dtype=dtype)
    t.untyped_storage().resize_(0)
    return t


class _CodedRows:
    """Row slabs of a packed b12-coded matrix read from its file, each a coded matrix of its own (kernels/b12.py's
    layout: the slab's slots, its base bytes, its rows' exceptions (b12x) with their offsets rebased, then its rows
    stored whole, whose slot offsets are rewritten). The matrix's base bytes and exception table are read, and the
    table checked, once."""

    def __init__(self, info: TensorInfo):
        self.info = info
        self.n, self.k = info.shape
        self.slot = b12.slot_bytes(self.k)
        self.bases = read_range(info.file, info.offset + self.n * self.slot, self.n)  # one byte a row
        bases = torch.frombuffer(self.bases, dtype=torch.uint8)
        self.raw = (bases == b12.RAW).nonzero().flatten().tolist()
        self.offsets = self.entries = None  # the exception table (b12x), where any row has exceptions
        if bool(((bases & b12.XFLAG).bool() & (bases != b12.RAW)).any()):
            at = info.offset + self.n * self.slot + -(-self.n // 64) * 64
            count = int.from_bytes(bytes(read_range(info.file, at + 4 * self.n, 4)), "little")  # the last offset
            table = read_range(info.file, at, min(b12.table_nbytes(self.n, max(1, count)),
                                                  info.offset + info.nbytes - at))  # (check_table: too short)
            try:
                got = b12.check_table(bases, torch.frombuffer(table, dtype=torch.uint8), self.n, self.k)
            except ValueError as e:
                raise CheckpointError(f"{info.file}: tensor {info.name!r}: {e}") from None
            self.offsets, self.entries = got[0], got[1].to(torch.int32)  # (the entries' bits, as stored)

    def _raw(self, start: int, n: int) -> list[int]:
        """The rows stored whole among [start, start + n), relative to start."""
        lo, hi = bisect.bisect_left(self.raw, start), bisect.bisect_left(self.raw, start + n)
        return [r - start for r in self.raw[lo:hi]]

    def _exceptions(self, start: int, n: int) -> int:
        return 0 if self.offsets is None else int(self.offsets[start + n] - self.offsets[start])

    def nbytes(self, start: int, n: int) -> int:
        return b12.coded_nbytes(n, self.k, len(self._raw(start, n)), self._exceptions(start, n))

    def span(self, start: int, n: int) -> int:
        """Bytes a direct read of rows [start, start + n) needs (read_direct's `into`)."""
        return direct_span(self.info.offset + start * self.slot, n * self.slot, self.nbytes(start, n) - n * self.slot)

    def read(self, start: int, n: int, direct: bool = False, into: mmap.mmap | None = None) -> B12Weight:
        """Rows [start, start + n) as a coded matrix; `direct`: their slots by one O_DIRECT read where the file
        allows it (read_direct, into `into` where given), the rest of the slab's bytes written after them in the
        same pages."""
        raw, exc = self._raw(start, n), self._exceptions(start, n)
        total, slots = b12.coded_nbytes(n, self.k, len(raw), exc), n * self.slot
        f, at = self.info.file, self.info.offset
        got = read_direct(f, at + start * self.slot, slots, total - slots, into=into) if direct else None
        if got is not None:
            buf = torch.frombuffer(got[0], dtype=torch.uint8, offset=got[1], count=total)
            buf[slots:].zero_()  # (the aligned read ran past the slots)
        elif into is not None:
            buf = torch.frombuffer(into, dtype=torch.uint8, count=total)
            buf.zero_()
        else:
            buf = torch.zeros(total, dtype=torch.uint8)
        mem = (ctypes.c_char * total).from_address(buf.data_ptr())
        if got is None:
            read_range(f, at + start * self.slot, slots, out=(ctypes.c_char * slots).from_buffer(mem))
        buf[n * self.slot:n * self.slot + n] = torch.frombuffer(self.bases[start:start + n], dtype=torch.uint8)
        head, width = n * self.slot + -(-n // 64) * 64, 2 * self.k
        if exc:  # the slab's own table, from its rows' exception counts and entries
            lo = int(self.offsets[start])
            table = b12.table_bytes(n, torch.diff(self.offsets[start:start + n + 1]), self.entries[lo:lo + exc])
            buf[head:head + len(table)] = torch.frombuffer(bytearray(table), dtype=torch.uint8)
            head += len(table)
        for j, i in enumerate(raw):  # a row stored whole: read from where the matrix keeps it, its offset rewritten
            slot = buf[i * self.slot:i * self.slot + 8]
            old = int(slot.view(torch.int64))
            read_range(f, at + old, width, out=(ctypes.c_char * width).from_buffer(mem, head + j * width))
            slot.copy_(torch.tensor([head + j * width], dtype=torch.int64).view(torch.uint8))
        return B12Weight.wrap(buf, (n, self.k))


class DenseStreamer:
    """Runs a ResidencyPlan: tensors for streamed layers in kept slots (or placeholders), filled before each use.

    The decoder loops call `enter(l)` before layer l and `leave(l)` after it. At `enter(l)` layer l is made present
    (waiting for its read) and the read of the next streamed layer (in loop order, wrapping to the next step) is
    started on the reader threads, so at most two streamed layers are in RAM: the current one and the next (with
    an odd number of streamed layers in slots, the last and the first share a slot: the first is read at the
    last one's `leave`). Their bytes are counted by the accountant (`add_stream`), inside the reserve the plan set
    aside: the slots for as long as they are kept, placeholders' storage while it holds a layer.
    """

    def __init__(self, index: CheckpointIndex, prefix: str, memory, plan: ResidencyPlan, dense_names: list[str]):
        """dense_names: the checkpoint's dense tensors (ModelPlan.dense_names), where the streamed ones are found."""
        self.index, self.prefix, self.memory, self.plan = index, prefix, memory, plan
        self.order = plan.streamed_layers
        self.tensors: dict[str, torch.Tensor] = {}
        self.by_layer: dict[int, list[tuple[torch.Tensor, TensorInfo]]] = {l: [] for l in self.order}
        self.present: set[int] = set()
        self.pending: dict[int, list[Future]] = {}
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="moestream-dense")
        self.bytes_read = 0  # tensor bytes read (layers, embedding rows, lm_head slabs)
        self.wait_s = 0.0  # time the decoder loop waited for a layer's read (reads not hidden behind compute)
        self._no_direct = False  # O_DIRECT refused here (the head's slabs are then read buffered)
        self._head_kept: list | None = None  # the two buffers streamed head slabs are read into (_head_buffers)
        self._head_counted = 0
        # streamed layers' tensors in two kept slots on huge pages (_plan_slots): the slot of each streamed layer,
        # the place of each of their tensors (by checkpoint name) in it
        self._slots: list = []
        self._place: dict[str, int] = {}
        self._slot_of: dict[int, int] = {}
        self._slot_counted = 0
        self._plan_slots(dense_names)
        self.head_part = None  # the head's resident leading rows (plan.head_resident_rows), read once here
        if plan.head_streamed and plan.head_resident_rows:
            info = self._table_info(HEAD if not plan.tied else EMBED)
            row = info.nbytes // info.shape[0]
            if info.codec == "b12":  # a coded head's leading rows: a coded matrix of their own (_CodedRows)
                t = _coded_head(info, strict=True).read(0, plan.head_resident_rows)
            else:
                t = torch.empty(plan.head_resident_rows, info.shape[1], dtype=info.torch_dtype)
                read_range(info.file, info.offset, plan.head_resident_rows * row, out=_buffer(t.untyped_storage()))
            memory.add_dense(t.numel() * t.element_size())
            self.head_part = t

    def _plan_slots(self, dense_names: list[str]) -> None:
        """Places for the streamed layers' tensors in two slots kept for the engine's life, on huge pages where the
        kernel offers them (weights/pages.py): the streamed layers take the slots in turn (a layer is read into one
        while the one before it computes in the other), each layer's tensors in file order, each at the first place
        at or after the previous one's end that is congruent to its file offset modulo ALIGN, so the aligned inside
        of its bytes is read by O_DIRECT straight into place. Why: fresh memory for every read faults its pages in
        (about 2 GB/s on this VM) and scatters the disk requests (docs/performance.md, "Streamed dense weights into
        kept huge pages"). The slots are booked as the plan's layer buffers (two of the largest layer's bytes; the
        gaps, under ALIGN bytes a tensor, are measured as unbooked memory). Nothing is kept where a shard is not a
        local file, O_DIRECT is missing, or a place would not suit a tensor's dtype: each read then takes storage
        of its own."""
        if not self.order or not hasattr(os, "O_DIRECT"):
            return
        items: dict[int, list[TensorInfo]] = {l: [] for l in self.order}
        for full in dense_names:
            name, info = full[len(self.prefix):], self.index[full]
            layer = layer_of(name)
            if layer in items and streamable(name, info):
                if not isinstance(info.file, Path):
                    return
                items[layer].append(info)
        place, size = {}, 0
        for infos in items.values():
            pos = 0
            for info in sorted(infos, key=lambda i: (str(i.file), i.offset)):
                pos += (info.offset - pos) % ALIGN
                width = 1 if info.codec == "b12" else info.torch_dtype.itemsize
                if pos % width:
                    return
                place[info.name] = pos
                pos += info.nbytes
            size = max(size, pos)
        if size == 0:
            return
        self._slot_of = {layer: i % 2 for i, layer in enumerate(self.order)}
        self._place = place
        self._slots = [pages.anon_buffer(size) for _ in range(2 if len(self.order) > 1 else 1)]
        self._slot_counted = self.plan.layer_buffer_bytes
        self.memory.add_stream(self._slot_counted)

    def _slot_tensor(self, info: TensorInfo, layer: int) -> torch.Tensor:
        """A streamed tensor over its place in its layer's slot (its bytes are there while the layer is present)."""
        slot, pos = self._slot_of[layer], self._place[info.name]
        if info.codec == "b12":
            return B12Weight.wrap(torch.frombuffer(self._slots[slot], dtype=torch.uint8, count=info.nbytes,
                                                   offset=pos), info.shape)
        n = info.nbytes // info.torch_dtype.itemsize
        return torch.frombuffer(self._slots[slot], dtype=info.torch_dtype, count=n, offset=pos).view(info.shape)

    # -- what the model's weights ask -------------------------------------------------------------------------
    def streams(self, name: str) -> bool:
        if name == EMBED:
            return self.plan.embed_streamed
        if name == HEAD:
            return self.plan.head_streamed
        layer = layer_of(name)
        return layer in self.by_layer and streamable(name, self.index[self.prefix + name])

    def tensor(self, name: str) -> torch.Tensor:
        """The one tensor the model gets for a streamed tensor: a view of its place in its slot (_plan_slots), else a
        placeholder whose storage is empty until its layer is entered."""
        if name not in self.tensors:
            info = self.index[self.prefix + name]
            if info.name in self._place:
                t = self._slot_tensor(info, layer_of(name))
            elif info.codec == "b12":  # a packed coded matrix: its stored bytes, read by the kernels as they are
                _CodedRows(info)  # (its exception table checked once, before any step reads the bytes)
                t = B12Weight.wrap(_empty_placeholder((info.nbytes,), torch.uint8), info.shape)
            else:
                t = _empty_placeholder(info.shape, info.torch_dtype)
            self.tensors[name] = t
            layer = layer_of(name)
            if layer in self.by_layer:
                self.by_layer[layer].append((t, info))
        return self.tensors[name]

    # -- layers -------------------------------------------------------------------------------------------------
    def _next(self, layer: int) -> int | None:
        """The first streamed layer after `layer` in loop order (wrapping to the next step)."""
        for l in self.order:
            if l > layer:
                return l
        return self.order[0] if self.order else None

    def _start_in_slot(self, layer: int) -> None:
        """Queue the reads of a layer's tensors into their places in its slot (_plan_slots): the aligned inside of
        each tensor by O_DIRECT in pieces of READ_BYTES over the reader threads, its unaligned ends (and every
        byte, where O_DIRECT is refused) by buffered reads."""
        view = memoryview(self._slots[self._slot_of[layer]])
        futures = []
        for _, info in self.by_layer[layer]:
            pos, o, n = self._place[info.name], info.offset, info.nbytes
            a0, a1 = -(-o // ALIGN) * ALIGN, (o + n) // ALIGN * ALIGN
            if a1 <= a0:
                futures.append(self.pool.submit(read_into, info.file, o, [view[pos:pos + n]]))
                continue
            if a0 > o:
                futures.append(self.pool.submit(read_into, info.file, o, [view[pos:pos + a0 - o]]))
            for at in range(a0, a1, READ_BYTES):
                end = min(a1, at + READ_BYTES)
                futures.append(self.pool.submit(_read_aligned, info.file, at, view[pos + at - o:pos + end - o]))
            if o + n > a1:
                futures.append(self.pool.submit(read_into, info.file, a1, [view[pos + a1 - o:pos + n]]))
        self.pending[layer] = futures

    def _start(self, layer: int) -> None:
        """Allocate a layer's tensors and queue their reads: into a kept slot where the layers allow it
        (_start_in_slot), else one scatter read per run of nearby tensors in a shard into storage of their own,
        cut into pieces of READ_BYTES spread over the reader threads (a read waits for latency before bandwidth;
        several in flight hide it)."""
        if layer in self.present or layer in self.pending or not self.by_layer.get(layer):
            return
        if self._slots:
            self._start_in_slot(layer)
            return
        items = self.by_layer[layer]
        self.memory.add_stream(sum(info.nbytes for _, info in items))
        for t, info in items:
            t.untyped_storage().resize_(info.nbytes)
        futures = []
        for run in _runs(items):
            file, pos = run[0][1].file, run[0][1].offset
            views = []
            for t, info in run:
                if info.offset > pos:
                    views.append(memoryview(bytearray(info.offset - pos)))  # a small tensor in between: discarded
                views.append(memoryview(_buffer(t.untyped_storage())).cast("B"))
                pos = info.offset + info.nbytes
            for offset, piece in _pieces(run[0][1].offset, views, READ_BYTES):
                futures.append(self.pool.submit(read_into, file, offset, piece))
        self.pending[layer] = futures

    def _wait(self, layer: int) -> None:
        futures = self.pending.pop(layer, None)
        if futures is None:
            return
        t0 = time.perf_counter()
        error = None
        for fut in futures:  # every piece finishes (or fails) before the storage may be freed
            try:
                fut.result()
            except BaseException as e:
                error = error or e
        self.wait_s += time.perf_counter() - t0
        self.present.add(layer)
        if error is not None:
            self._drop(layer)
            raise error
        self.bytes_read += sum(info.nbytes for _, info in self.by_layer[layer])

    def _drop(self, layer: int) -> None:
        self.present.discard(layer)
        if self._slots:  # its slot stays mapped (and booked) for the next layer read into it
            return
        nbytes = 0
        for t, info in self.by_layer[layer]:
            t.untyped_storage().resize_(0)
            nbytes += info.nbytes
        self.memory.release_stream(nbytes)

    def enter(self, layer: int) -> None:
        """Before layer `layer` runs: its streamed weights present, the next streamed layer's read started."""
        nxt = self._next(layer)
        if self._slots and layer in self.by_layer and nxt != layer and self._slot_of[nxt] == self._slot_of[layer]:
            nxt = None  # an odd number of streamed layers: the next one shares this one's slot (read in leave)
        want = [l for l in dict.fromkeys([layer if layer in self.by_layer else None, nxt]) if l is not None]
        for other in list(self.present) + list(self.pending):  # after an interrupted step: back to two at most
            if other not in want:
                self._wait(other)
                if other in self.present:
                    self._drop(other)
        for l in want:  # this layer's read (if it is not in flight yet) is queued before the next one's
            self._start(l)
        if layer in self.by_layer:
            self._wait(layer)

    def leave(self, layer: int) -> None:
        if layer in self.present:
            self._drop(layer)
            nxt = self._next(layer)
            if nxt == layer or self._slots and self._slot_of[nxt] == self._slot_of[layer]:
                self._start(nxt)  # the only streamed layer again, or the next one that shares its slot

    # -- embedding and head --------------------------------------------------------------------------------------
    def _table_info(self, name: str) -> TensorInfo:
        return self.index[self.prefix + name]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """`blocks.embed` without the table: the rows of the step's distinct tokens read from disk, fp32 [T, H]."""
        info = self._table_info(EMBED)
        vocab, hidden = info.shape
        row = info.nbytes // vocab
        ids, inverse = torch.unique(tokens, return_inverse=True)
        out = torch.empty(tokens.shape[0], hidden, dtype=torch.float32)
        per = max(1, EMBED_ROWS_BYTES // row)
        for s in range(0, ids.shape[0], per):
            chunk = ids[s:s + per].tolist()
            rows = torch.empty(len(chunk), hidden, dtype=info.torch_dtype)
            self.memory.add_stream(rows.numel() * rows.element_size())
            try:
                buf = _buffer(rows.untyped_storage())
                i = 0
                while i < len(chunk):  # one read per run of consecutive token ids
                    j = i + 1
                    while j < len(chunk) and chunk[j] == chunk[j - 1] + 1:
                        j += 1
                    view = (ctypes.c_char * ((j - i) * row)).from_buffer(buf, i * row)
                    read_range(info.file, info.offset + chunk[i] * row, (j - i) * row, out=view)
                    i = j
                self.bytes_read += len(chunk) * row
                sel = (inverse >= s) & (inverse < s + len(chunk))
                out[sel] = rows.index_select(0, inverse[sel] - s).float()
            finally:
                self.memory.release_stream(rows.numel() * rows.element_size())
        return out

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """`linear(x, lm_head)` [T, V]: the head's resident leading rows (plan.head_resident_rows) as they are, the
        others read slab by slab, the next slab in flight."""
        info = self._table_info(HEAD if not self.plan.tied else EMBED)
        vocab, hidden = info.shape
        row = info.nbytes // vocab
        first = 0 if self.head_part is None else self.plan.head_resident_rows
        slabs = [(s, n) for s, n in head_slabs(vocab, hidden, row) if s >= first]  # first: a slab boundary
        out = torch.empty(x.shape[0], vocab, dtype=torch.float32)
        if first:
            out[:, :first] = linear(x, self.head_part)
        coded = _coded_head(info, strict=True) if info.codec == "b12" else None
        kept = self._head_buffers(info, slabs, coded, row) if slabs else None

        def read(i: int, start: int, n: int) -> torch.Tensor:
            into = kept[i % 2] if kept else None
            if coded is not None:
                return coded.read(start, n, direct=not self._no_direct, into=into)
            got = self._read_direct(info, info.offset + start * row, n * row, into=into)
            if got is not None:
                return got.view(info.torch_dtype).view(n, hidden)
            if into is not None:
                t = torch.frombuffer(into, dtype=info.torch_dtype, count=n * hidden).view(n, hidden)
            else:
                t = torch.empty(n, hidden, dtype=info.torch_dtype)
            read_range(info.file, info.offset + start * row, n * row, out=_buffer(t.untyped_storage()))
            return t

        inflight: list[tuple[Future, int, int]] = []  # (read, its bytes, bytes counted for it) of the slab in flight

        def submit(i: int) -> None:
            nbytes = coded.nbytes(*slabs[i]) if coded is not None else slabs[i][1] * row
            counted = 0 if kept else nbytes  # the kept buffers are counted while they are held
            self.memory.add_stream(counted)
            inflight.append((self.pool.submit(read, i, *slabs[i]), nbytes, counted))

        submit(0)
        try:
            for i, (start, n) in enumerate(slabs):
                fut, nbytes, counted = inflight[0]
                slab = fut.result()
                inflight.pop(0)
                self.bytes_read += nbytes
                try:
                    if i + 1 < len(slabs):
                        submit(i + 1)
                    out[:, start:start + n] = linear(x, slab)
                finally:
                    del slab
                    self.memory.release_stream(counted)
        finally:
            for fut, _, counted in inflight:  # after an error: wait for the read in flight, give its bytes back
                try:
                    fut.result()
                except BaseException:
                    pass
                self.memory.release_stream(counted)
        return out

    def _head_buffers(self, info: TensorInfo, slabs: list[tuple[int, int]], coded, row: int) -> list | None:
        """The two buffers a streamed head's slabs are read into, one slab computing while the next is read: made
        at the first step and kept (counted as streamed bytes while held), on huge pages where the kernel offers
        them (weights/pages.py). Why kept: an O_DIRECT read is cut into one disk request per physically contiguous
        stretch of its buffer, and fresh 4 KiB pages come scattered: on this VM 64 MiB slabs read at 1.2 GB/s into
        fresh mappings (requests of ~1 MiB), 1.2 into kept 4 KiB-page ones (528 KiB), 3.3 into kept huge pages (4
        MiB requests; docs/performance.md). None where the file is not a local one read directly."""
        if self._head_kept is not None or self._no_direct or not hasattr(os, "O_DIRECT") \
                or not isinstance(info.file, Path):
            return self._head_kept
        if coded is not None:
            size = max(coded.span(s, n) for s, n in slabs)
        else:
            size = max(direct_span(info.offset + s * row, n * row) for s, n in slabs)
        self._head_counted = 2 * self.plan.head_slab_bytes  # (the alignment pages around a slab: 8 KiB at most)
        self.memory.add_stream(self._head_counted)
        self._head_kept = [pages.anon_buffer(size), pages.anon_buffer(size)]
        return self._head_kept

    def _read_direct(self, info: TensorInfo, offset: int, nbytes: int, into: mmap.mmap | None = None
                     ) -> torch.Tensor | None:
        """[offset, offset + nbytes) of a local shard as uint8 by one O_DIRECT read (read_direct, into `into`
        where given); None where O_DIRECT or the dtype's alignment does not allow it (the caller reads buffered)."""
        if self._no_direct or (offset - offset // ALIGN * ALIGN) % 8:
            return None
        got = read_direct(info.file, offset, nbytes, into=into)
        if got is None:
            self._no_direct = True
            return None
        return torch.frombuffer(got[0], dtype=torch.uint8, offset=got[1], count=nbytes)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self._slot_counted:
            self.memory.release_stream(self._slot_counted)
            self._slot_counted = 0
        if self._head_kept is not None:
            self._head_kept = None
            self.memory.release_stream(self._head_counted)
