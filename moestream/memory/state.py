"""Per-sequence state and the batch layout one engine step works on.

Owns `SeqState` (one slot per layer for KV caches or recurrent state, the token count, the KV storage dtype), the
block-allocated, budget-accounted `BlockBuffer` that holds KV / latent caches (fixed-size blocks on slab slots,
memory/slabs.py, never copied to grow, charged the pages their rows take as rows are appended (`BlockLayout`); with a
sliding window each block is charged whole and whole blocks are dropped), and `transient`, which charges a temporary.
Models create their per-layer state lazily through `slot()`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from moestream.config import KV_DTYPE_NAMES
from moestream.errors import MoestreamError
from moestream.kernels import kvquant
from moestream.memory.accountant import MemoryAccountant
from moestream.memory.slabs import PAGE, free_block, new_block, slot_bytes

BLOCK_TOKENS = 64  # rows per KV block: a batch of short sequences holds ~its context, not 256 rows each
GROW_TOKENS = BLOCK_TOKENS  # the old name (tests and docs speak of growth in 64-token steps)
# Python-side bytes a running sequence holds outside its tensors (its request and ticket, sampler, decoder, and a
# cache object per layer): tracemalloc measured ~7 KiB + ~1.5 KiB a layer (docs/memory.md), booked with headroom.
HOST_BYTES_BASE = 8 << 10
HOST_BYTES_PER_LAYER = 2 << 10
# ... and each cache block's tensor object (torch's TensorImpl and the Python wrapper of a view on its slab slot:
# ~600 bytes measured, docs/performance.md), which tracemalloc does not see: charged with the block
BLOCK_HOST_BYTES = 640
# --kv-dtype: storage; compute stays fp32 (int8 / int4: grouped integers with fp32 scales, kernels/kvquant.py; int4
# is named by kvquant's dtype tag)
KV_DTYPES = dict(zip(KV_DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.int8, kvquant.INT4)))


def kv_dtype(name: str) -> torch.dtype:
    """The torch dtype of a --kv-dtype name; a clear error for anything else."""
    if name not in KV_DTYPES:
        raise MoestreamError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}; got {name!r}")
    return KV_DTYPES[name]


def stored_row_bytes(row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes one cache row of this shape takes in `dtype`'s storage (int8 / int4: its values and group scales)."""
    if kvquant.bits_of(dtype):
        return kvquant.row_bytes(row_shape, kvquant.bits_of(dtype))
    return math.prod(row_shape) * dtype.itemsize


def block_bytes(rows: int, row_bytes: int, quantized: bool) -> int:
    """Bytes a block of `rows` rows charges: the rows, or for int8 / int4 the whole slab slot (whole pages) it
    takes."""
    return slot_bytes(rows * row_bytes) if quantized else rows * row_bytes


def block_charge(storage_bytes: int) -> int:
    """Bytes the budget is charged for one block of `storage_bytes`: its storage and its tensor object's host
    memory (BLOCK_HOST_BYTES)."""
    return storage_bytes + BLOCK_HOST_BYTES


class BlockLayout:
    """Where a block's rows lie in its slot, for a charge by the pages its written rows take. A block's slot is
    mapped fresh (memory/slabs.py): a page of it is resident only once a row written into it reaches it, so a
    block holding r rows is charged the whole pages its first r rows lie in (each region rows fill from its
    start: the rows themselves, or for int8 / int4 their scales and their values), at most the block's bytes, and
    its tensor object's BLOCK_HOST_BYTES. `charges[r]` is that for r rows (charges[block] = block_charge), and
    `headroom[r]` how many more rows a block holding r takes before its charge rises."""

    def __init__(self, block: int, nbytes: int, spans: tuple[tuple[int, int], ...]):
        self.block, self.spans = block, spans  # spans: (offset in the slot, bytes a row)
        self.charges = [0] + [block_charge(min(nbytes, self._pages(r) * PAGE)) for r in range(1, block)] \
            + [block_charge(nbytes)]
        self.whole = self.charges[block]  # a full block's charge
        self.headroom = [0] * (block + 1)
        for r in range(block - 1, 0, -1):
            self.headroom[r] = self.headroom[r + 1] + 1 if self.charges[r + 1] == self.charges[r] else 0

    def _pages(self, rows: int) -> int:
        pages: set[int] = set()
        for off, per in self.spans:
            pages.update(range(off // PAGE, -(-(off + rows * per) // PAGE)))
        return len(pages)

    def charge_at(self, rows: int) -> int:
        """Bytes charged for a buffer's first `rows` rows (whole blocks, then the last block's pages)."""
        full, rem = divmod(rows, self.block)
        return full * self.whole + self.charges[rem]

    def rows_free(self, rows: int) -> int:
        """Rows a buffer holding `rows` may append before its charge rises (0 when its last block is full)."""
        return self.headroom[rows % self.block] if rows % self.block else 0


_LAYOUTS: dict[tuple, BlockLayout] = {}


def block_layout(block: int, nbytes: int, spans: tuple[tuple[int, int], ...]) -> BlockLayout:
    """The BlockLayout of these blocks (one object for all the buffers that share it)."""
    key = (block, nbytes, spans)
    got = _LAYOUTS.get(key)
    if got is None:
        got = _LAYOUTS[key] = BlockLayout(block, nbytes, spans)
    return got


def block_shape(row_bytes: int, bits: int = 0) -> tuple[int, int]:
    """(rows, bytes) of one cache block whose rows take `row_bytes`: BLOCK_TOKENS rows for fp32 / bf16 (`bits` 0).
    A quantised block (`bits` 8 or 4 a value; its rows carry their scales, so are rarely a power of two) fills
    whole pages instead, the slab slot it lives in, with as many rows as fit: 272-byte int8 rows take 75 a block in
    5 pages, where 64 would have left 15% of the slot unused but resident. The pages are those of BLOCK_TOKENS rows
    at 8 bits a value, i.e. BLOCK_TOKENS x 8 / bits rows: a block's bytes, and so the share its fixed costs take (its
    host charge, BLOCK_HOST_BYTES, and its entry in every step's block tables), stay int8's when the values narrow,
    and the tail a sequence leaves unused (under a block a buffer) is no more than int8's in bytes; 144-byte int4
    rows take 142 a block in the 5 pages int8's 75 take. A 64-row minimum (85 rows in 3 pages) would hold fewer bytes
    at some contexts (under 86 tokens) and more at others (86 to 142 tokens); about even on average (docs/memory.md)."""
    if not bits:
        return BLOCK_TOKENS, BLOCK_TOKENS * row_bytes
    nbytes = slot_bytes(BLOCK_TOKENS * 8 // bits * row_bytes)
    return nbytes // row_bytes, nbytes


def blocks_held(length: int, n: int, window: int | None, block: int = BLOCK_TOKENS) -> int:
    """Blocks a BlockBuffer holding `length` rows holds after appending `n` more (its trim and growth replayed):
    with a window, rows before the first new query's window (length - window + 1) go, a whole block at a time."""
    first = 0 if window is None else max(0, length - window + 1) // block * block
    return -(-(length + n - first) // block)


@contextlib.contextmanager
def transient(memory: MemoryAccountant, nbytes: int, what: str) -> Iterator[None]:
    """Charge a temporary allocation (attention tiles, a gathered cache, all-position logits) for the duration:
    experts are evicted to make room, and a budget that cannot hold it is a BudgetError before it is allocated."""
    memory.grow_state(nbytes, what)
    try:
        yield
    finally:
        memory.release_state(nbytes)


def scratch_budget(memory: MemoryAccountant, default: int) -> int:
    """Bytes of scratch one compute phase should plan for: the fixed scratch allowance under a budget (the phases
    that use scratch -- dense upcast slab, expert upcast, attention tiles, KDA chunks, gathered caches -- run one
    after another, so they share it), `default` without one."""
    return min(default, memory.scratch_bytes) if memory.limited else default


def beyond_allowance(memory: MemoryAccountant, nbytes: int) -> int:
    """The part of `nbytes` of compute scratch that the fixed scratch allowance does not cover (what is charged)."""
    return max(0, nbytes - memory.scratch_bytes)


@contextlib.contextmanager
def scratch(memory: MemoryAccountant, nbytes: int, what: str) -> Iterator[None]:
    """Use `nbytes` of compute scratch: the part the fixed scratch allowance does not cover is charged meanwhile."""
    with transient(memory, beyond_allowance(memory, nbytes), what):
        yield


class BlockBuffer:
    """Rows [length, *row_shape] of one dtype in fixed blocks of `block` rows. Without a window the budget is
    charged the pages the rows take as they are appended (BlockLayout: a block's slot is resident only where rows
    were written; a block is never an old + new copy); appends write in place. With a `window` each block is charged
    whole when allocated, and the blocks wholly before the next query's window are dropped (reused for the next
    rows, whose pages their earlier rows made resident), so a sliding-window cache holds at most window + chunk +
    one block of rows. Readers iterate `tiles()` or take a contiguous `gather()`.

    With dtype torch.int8 or kvquant.INT4 (`--kv-dtype int8 / int4`) a block is one uint8 slot of whole pages
    holding the block's fp32 group scales and then its int8 (or packed int4) rows (kernels/kvquant.py), as many rows
    as fill the pages (`block_shape`); rows are quantised when written and read back as fp32."""

    def __init__(self, memory: MemoryAccountant, row_shape: tuple[int, ...], what: str = "KV cache",
                 dtype: torch.dtype = torch.float32, window: int | None = None, block: int | None = None):
        self.memory, self.row_shape, self.what, self.dtype = memory, tuple(row_shape), what, dtype
        self.window = window
        self.block = block_shape(self.row_bytes, self.bits)[0] if block is None else block
        self.blocks: list[torch.Tensor] = []
        self.version = 0  # counts changes of `blocks` (a block added, dropped or given back): names the list
        self.start = 0  # absolute index of blocks[0]'s first row (a multiple of block)
        self.length = 0  # rows appended so far (absolute)
        self.charged = 0  # bytes charged to the budget now
        self._free_rows = 0  # rows that may be appended before the charge rises (no window)
        self.layout = self._layout()  # where a block's rows lie (the pages its first rows take)

    @property
    def bits(self) -> int:
        """Bits a stored value: 8 (int8) or 4 (int4) when quantised, else 0."""
        return kvquant.bits_of(self.dtype)

    @property
    def quantized(self) -> bool:
        return self.bits != 0

    @property
    def tile_dtype(self) -> torch.dtype:
        """The dtype `tiles()` gives rows in without an extra conversion: the storage's, fp32 when quantised."""
        return torch.float32 if self.quantized else self.dtype

    @property
    def elements(self) -> int:
        return math.prod(self.row_shape)

    @property
    def row_bytes(self) -> int:
        return stored_row_bytes(self.row_shape, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes one block charges: its rows, or when quantised its whole slot (whole pages)."""
        return block_bytes(self.block, self.row_bytes, self.quantized)

    @property
    def block_charge(self) -> int:
        """Bytes the budget is charged per whole block (block_charge)."""
        return block_charge(self.block_bytes)

    def _layout(self) -> BlockLayout:
        """Where the rows lie in a block (the pages a block's first rows take): the rows, or for int8 / int4 their
        fp32 scales (all the block's first) and then their values (_parts)."""
        if not self.quantized:
            spans = ((0, self.row_bytes),)
        else:
            scale_row = kvquant.scale_bytes(self.row_shape)
            spans = ((0, scale_row), (self.block * scale_row, kvquant.value_bytes(self.row_shape, self.bits)))
        return block_layout(self.block, self.block_bytes, spans)

    @property
    def nbytes(self) -> int:
        """Bytes charged to the budget now."""
        return self.charged

    @property
    def kept(self) -> int:
        """Rows held (from `start` to `length`)."""
        return self.length - self.start

    def growth(self, n: int) -> int:
        """Bytes appending `n` rows will charge (the pages they reach; with a window, blocks beyond those held)."""
        if self.window is None:
            return 0 if n <= self._free_rows else self.layout.charge_at(self.length + n) - self.charged
        return max(0, blocks_held(self.length, n, self.window, self.block) - len(self.blocks)) * self.block_charge

    def _new_block(self) -> torch.Tensor:
        if self.quantized:
            return new_block((self.block_bytes,), torch.uint8)
        return new_block((self.block, *self.row_shape), self.dtype)

    def _parts(self, blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantised block's (values, scales [block, *lead, groups] fp32) views: values int8 [block, *row_shape],
        or for int4 packed uint8 [block, *lead, last / 2]."""
        groups = self.row_shape[-1] // kvquant.group_of(self.row_shape[-1])
        n = self.block * kvquant.scale_bytes(self.row_shape)
        scales = blk[:n].view(torch.float32).view(self.block, *self.row_shape[:-1], groups)
        values = blk[n:n + self.block * kvquant.value_bytes(self.row_shape, self.bits)]
        if self.bits == 8:
            return values.view(torch.int8).view(self.block, *self.row_shape), scales
        return values.view(self.block, *self.row_shape[:-1], self.row_shape[-1] // 2), scales

    def _write(self, blk: torch.Tensor, r: int, rows: torch.Tensor, pre: kvquant.Quantized | None = None) -> None:
        """Store rows at row r of a block (converted to, or quantised for, the storage; a quantised buffer takes
        `pre`, the same rows already quantised at its bits, when given)."""
        if not self.quantized:
            blk[r:r + rows.shape[0]] = rows
            return
        values, scales = self._parts(blk)
        q, s = (pre.values, pre.scales) if pre is not None else kvquant.quantize(rows, self.bits)
        values[r:r + rows.shape[0]] = q
        scales[r:r + rows.shape[0]] = s

    def _read(self, blk: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.quantized:
            return blk[:n].to(dtype)
        values, scales = self._parts(blk)
        return kvquant.dequantize(values[:n], scales[:n], self.bits).to(dtype)

    def stored(self, rows: torch.Tensor) -> torch.Tensor:
        """The fp32 values this buffer gives back for rows once stored (its storage's rounding)."""
        if self.quantized:
            return kvquant.roundtrip(rows, self.bits)
        return rows.to(self.dtype).float()

    def push(self, rows: torch.Tensor, pre: kvquant.Quantized | None = None) -> None:
        """Append rows [n, *row_shape] (converted to the storage dtype; for a quantised buffer, `pre` is the same
        rows already quantised by kvquant.quantized at its bits, written as they are)."""
        n = rows.shape[0]
        self._room(n)
        at = 0
        while at < n:
            b, r = divmod(self.length - self.start, self.block)
            take = min(self.block - r, n - at)
            part = None if pre is None else pre.rows(slice(at, at + take))
            self._write(self.blocks[b], r, rows[at:at + take], part)
            at += take
            self.length += take

    def reserve(self, n: int) -> None:
        """Make room for `n` more rows and count them as appended, without writing them: a kernel writes them in
        place (kernels/paged.py). Charged like `push`."""
        self._room(n)
        self.length += n

    def _room(self, n: int) -> None:
        """Blocks for `n` more rows: dropped ones reused first, new ones charged before they are allocated (without a
        window: the pages the rows reach, charged before they are written)."""
        if self.window is None:
            if n <= self._free_rows:  # the rows' pages are charged already (most decode appends)
                self._free_rows -= n
                return
            layout = self.layout
            self.version += 1
            charge = layout.charge_at(self.length + n)
            self.memory.grow_state(charge - self.charged, self.what)  # BudgetError before anything is allocated
            for _ in range(blocks_held(self.length, n, None, self.block) - len(self.blocks)):
                self.blocks.append(self._new_block())
            self.charged, self._free_rows = charge, layout.rows_free(self.length + n)
            return
        free = self._trim()
        self.version += 1
        need = blocks_held(self.length, n, self.window, self.block) - len(self.blocks)
        charge = max(0, need - len(free)) * self.block_charge
        self.memory.grow_state(charge, self.what)  # BudgetError before anything is allocated
        for _ in range(need):
            self.blocks.append(free.pop() if free else self._new_block())
        for blk in free:  # dropped blocks this append did not reuse
            free_block(blk)
        self.memory.release_state(len(free) * self.block_charge)
        self.charged = len(self.blocks) * self.block_charge

    def _trim(self) -> list[torch.Tensor]:
        """Drop the blocks no query from `length` on can see (window only); returns them for reuse."""
        if self.window is None:
            return []
        keep = max(0, self.length - self.window + 1) // self.block * self.block
        dropped = []
        while self.start < keep:
            dropped.append(self.blocks.pop(0))
            self.start += self.block
        return dropped

    def tiles(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[int, torch.Tensor]]:
        """(absolute index of the first row, rows [n, *row_shape] in `dtype`) for each block, oldest first."""
        for i, blk in enumerate(self.blocks):
            first = self.start + i * self.block
            yield first, self._read(blk, min(self.block, self.length - first), dtype)

    def gather(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The held rows [kept, *row_shape] contiguous in `dtype`: a view when one block of that dtype holds them,
        else a copy (a temporary the caller charges with `transient` when it can be large)."""
        if len(self.blocks) == 1 and self.dtype == dtype and not self.quantized:
            return self.blocks[0][:self.kept]
        if not self.blocks:
            return torch.empty((0, *self.row_shape), dtype=dtype)
        return torch.cat([rows for _, rows in self.tiles(dtype)])

    def gather_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of a gathered copy of the held rows in `dtype`."""
        return self.kept * self.elements * dtype.itemsize

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """push(rows), then the held rows as fp32 (gather)."""
        self.push(rows)
        return self.gather()

    def view(self) -> torch.Tensor:
        """The held rows as `tiles()` gives them (storage dtype, fp32 when quantised; a copy past one block)."""
        return self.gather(self.tile_dtype)

    def overwrite_tail(self, rows: torch.Tensor) -> None:
        """Replace the last rows.shape[0] rows (a kernel that normalised and roped them in a gathered copy)."""
        base = self.length - rows.shape[0]
        for b, blk in enumerate(self.blocks):
            first = self.start + b * self.block
            lo, hi = max(first, base), min(first + self.block, self.length)
            if lo < hi:
                self._write(blk, lo - first, rows[lo - base:hi - base])

    def clone(self, rows: int | None = None) -> "BlockBuffer":
        """A copy holding the first `rows` rows (default all), not charged (the caller charges `clone_bytes`). Without
        a window only the rows are copied (the pages they take, what clone_bytes charges)."""
        n = self.length if rows is None else rows
        new = BlockBuffer(self.memory, self.row_shape, self.what, self.dtype, self.window, self.block)
        new.start, new.length = self.start, n
        for i, b in enumerate(self.blocks[:-(-(n - self.start) // self.block)]):
            dst = new_block(tuple(b.shape), b.dtype)
            new.blocks.append(dst)
            r = min(self.block, n - self.start - i * self.block)
            if self.window is not None:
                dst.copy_(b)
            elif self.quantized:  # a flat slot: each region's first r rows
                for off, per in self.layout.spans:
                    dst[off:off + r * per].copy_(b[off:off + r * per])
            else:
                dst[:r].copy_(b[:r])
        new.charged = self.clone_bytes(n)
        if self.window is None:
            new._free_rows = self.layout.rows_free(n)
        return new

    def clone_bytes(self, rows: int | None = None) -> int:
        n = self.length if rows is None else rows
        if self.window is None:
            return self.layout.charge_at(n)
        return -(-(n - self.start) // self.block) * self.block_charge

    def release(self) -> None:
        """Give every block back (its pages to the kernel) and its bytes to the budget."""
        self.memory.release_state(self.charged)
        for blk in self.blocks:
            free_block(blk)
        self.blocks, self.start, self.length, self.charged, self._free_rows = [], 0, 0, 0, 0
        self.version += 1


@dataclass
class SeqState:
    """Everything one sequence carries between steps."""

    memory: MemoryAccountant
    num_layers: int
    pos: int = 0  # tokens already processed
    layers: list[Any] = field(default_factory=list)
    fixed_bytes: int = 0  # accounted fixed-size state (recurrent matrices, conv windows)
    host_bytes: int = 0  # accounted Python-side bookkeeping (a scheduler's sequences book it: account_host)
    kv_dtype: torch.dtype = torch.float32  # storage of KV / latent caches (EngineOptions.kv_dtype)
    slots_made: int = field(default=0, compare=False)  # layer slots made, and release()s: what caches of them key on
    derived: Any = field(default=None, repr=False, compare=False)  # such a cache (server/prefix.py held_buffers)

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = [None] * self.num_layers

    def slot(self, layer: int, factory: Callable[[], Any]) -> Any:
        if self.layers[layer] is None:
            self.layers[layer] = factory()
            self.slots_made += 1
        return self.layers[layer]

    def buffer(self, row_shape: tuple[int, ...], what: str = "KV cache", window: int | None = None) -> BlockBuffer:
        """A new cache buffer of this sequence's KV dtype, charged to its accountant."""
        return BlockBuffer(self.memory, row_shape, what, self.kv_dtype, window)

    def account_fixed(self, nbytes: int, what: str = "recurrent state") -> None:
        self.memory.grow_state(nbytes, what)
        self.fixed_bytes += nbytes

    def account_host(self) -> None:
        """Book this sequence's Python-side bookkeeping (`host_bytes_of`): hundreds of sequences in a batch hold
        megabytes of objects beside their caches, and the budget's RSS bound has to cover them too."""
        nbytes = host_bytes_of(self.num_layers)
        self.memory.grow_state(nbytes, "sequence bookkeeping")
        self.host_bytes += nbytes

    def release(self) -> None:
        for s in self.layers:
            for buf in _buffers(s):
                buf.release()
        self.memory.release_state(self.fixed_bytes + self.host_bytes)
        self.fixed_bytes = self.host_bytes = 0
        self.layers = [None] * self.num_layers
        self.slots_made += 1
        self.pos = 0


def host_bytes_of(num_layers: int) -> int:
    """Bytes booked for one running sequence's Python objects in a model of `num_layers` layers."""
    return HOST_BYTES_BASE + HOST_BYTES_PER_LAYER * num_layers


def _buffers(slot: Any) -> list[BlockBuffer]:
    if isinstance(slot, BlockBuffer):
        return [slot]
    if isinstance(slot, (list, tuple)):
        return [b for s in slot for b in _buffers(s)]
    if isinstance(slot, dict):
        return [b for s in slot.values() for b in _buffers(s)]
    return [v for v in vars(slot).values() if isinstance(v, BlockBuffer)] if hasattr(slot, "__dict__") else []


@dataclass
class Segment:
    """Rows [start, start + length) of a flat batch belong to `state`, at positions pos .. pos + length - 1."""

    state: SeqState
    start: int
    length: int
    pos: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


@dataclass
class Batch:
    segments: list[Segment]
    positions: torch.Tensor  # [T] long

    @classmethod
    def build(cls, items: list[tuple[SeqState, int]]) -> "Batch":
        segs, pos, start = [], [], 0
        for state, n in items:
            segs.append(Segment(state, start, n, state.pos))
            pos.extend(range(state.pos, state.pos + n))
            start += n
        return cls(segs, torch.tensor(pos, dtype=torch.long))
