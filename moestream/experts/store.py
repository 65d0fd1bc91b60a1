"""Expert store: where a routed expert's bytes live in the checkpoint and how to read them.

Owns the mapping (layer, expert) -> byte ranges in the shards, for checkpoints that store one tensor per expert
and for fused per-layer tensors (an expert is then a contiguous slice along dim 0), and each expert's read plan
(reader.py does the aligned, coalesced, page-cache-free reads into one recycled buffer per expert). In a packed
checkpoint (`moestream pack`, docs/pack.md) an expert is one aligned range: one read, and its crc32 is checked
on every read (a mismatch raises CheckpointError). It does not decide residency (cache.py) or compute (kernels/).
"""
from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from moestream.errors import CheckpointError
from moestream.kernels import b12
from moestream.kernels.b12 import B12Weight
from moestream.experts.reader import DEMAND, IO_THREADS, ReadPlan, Reader, Span, plan_reads
from moestream.weights.crc import crc32
from moestream.weights.index import DTYPES, CheckpointIndex, PackedExpert, bytes_to_tensor


def verify_default() -> bool:
    """Checksums of packed experts are verified on every read unless MOESTREAM_VERIFY=0."""
    return os.environ.get("MOESTREAM_VERIFY", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class PartSpec:
    """One tensor of an expert. `tensor` is a template with {layer} and, unless fused, {expert}."""

    name: str
    tensor: str
    fused: bool = False
    optional: bool = False

    def pattern(self, prefix: str = "") -> re.Pattern:
        esc = re.escape(prefix + self.tensor).replace(r"\{layer\}", r"\d+").replace(r"\{expert\}", r"\d+")
        return re.compile(esc + "$")


@dataclass(frozen=True)
class PartLocation:
    name: str
    file: object
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    group: int = -1  # packed checkpoints: the checksummed expert range (CheckpointIndex.packed) holding it
    codec: str | None = None  # "b12": the bytes are kernels/b12.py's coding of a bf16 matrix of `shape`


@dataclass(frozen=True)
class Check:
    """A packed expert's checksum: bytes [start, start + packed.nbytes) of the read buffer."""

    start: int
    packed: PackedExpert


class PartViews(dict):
    """An expert's part tensors by name (zero-copy views of its buffer). `ptrs` lets a kernel caller cache the
    parts' addresses for as long as the views live (they live as long as the blob): see `cached_addresses`."""

    __slots__ = ("ptrs",)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.ptrs = None


def cached_addresses(t, tag: str, make):
    """`make()` (what a kernel caller derives from an expert's parts: their addresses after its checks, or None when
    its kernel does not take them), cached under `tag` on a blob's PartViews, whose views live as long as the blob;
    other mappings derive it each call."""
    if not isinstance(t, PartViews):
        return make()
    if t.ptrs is not None and t.ptrs[0] == tag:
        return t.ptrs[1]
    got = make()
    t.ptrs = (tag, got)
    return got


class ExpertBlob:
    """One expert's bytes in a single buffer; `tensors()` gives zero-copy torch views per part."""

    __slots__ = ("buf", "parts", "nbytes", "_views", "layout")

    def __init__(self, buf, parts: list[tuple[str, int, PartLocation]], layout: tuple | None = None,
                 views: PartViews | None = None):
        self.buf = buf  # mmap (page-aligned, recycled on eviction) or bytearray
        self.parts = parts  # (part name, offset in buf, location in the checkpoint)
        self.nbytes = len(buf)
        self.layout = layout  # what the views depend on (`part_layout`), one object per distinct layout
        self._views: PartViews | None = views  # views an earlier expert of the same layout made over this buffer

    def tensors(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            mv = memoryview(self.buf)
            self._views = PartViews((name, _view(mv[off:off + loc.nbytes], loc)) for name, off, loc in self.parts)
        return self._views


def part_layout(parts: list[tuple[str, int, PartLocation]]) -> tuple:
    """What an expert's part views depend on besides its buffer: each part's name, offset, byte count, dtype, shape
    and codec (not its file or file offset). Experts of one layout reuse the views a recycled buffer carries."""
    return tuple((name, off, loc.nbytes, loc.dtype, tuple(loc.shape), loc.codec) for name, off, loc in parts)


class ExpertStore:
    def __init__(self, index: CheckpointIndex, parts: list[PartSpec], num_experts: int, prefix: str = "",
                 io_threads: int = IO_THREADS, direct_io: bool = True, verify: bool | None = None):
        self.index = index
        self.verify = verify_default() if verify is None else verify
        self.parts = parts
        self.prefix = prefix
        self.num_experts = num_experts
        # a remote checkpoint keeps more requests in flight than a local disk needs (weights/remote.py)
        self.reader = Reader(max(io_threads, getattr(index, "min_io_threads", 0)), direct_io)
        self._loc_cache: dict[tuple[int, int], list[PartLocation]] = {}
        self._expert_re = re.compile("|".join(f"(?:{p.pattern(prefix).pattern})" for p in parts) or "(?!)")
        if hasattr(index, "dense_filter"):  # a remote index fetches these ahead on its first dense load
            index.dense_filter = lambda n: n.startswith(prefix) and not self.is_expert_tensor(n)
        self._plans: dict[tuple[int, int], tuple[ReadPlan, list[tuple[str, int, PartLocation]]]] = {}
        self._layouts: dict[tuple[int, int], tuple] = {}  # expert -> its part_layout (the one object per layout)
        self._layout_ids: dict[tuple, tuple] = {}
        self._checks: dict[tuple[int, int], Check] = {}
        self.checksum_bytes = 0  # bytes of packed experts verified (and the time spent doing it)
        self.checksum_s = 0.0
        self._check_lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        """Bytes transferred from storage for experts (aligned runs, so slightly above the payload)."""
        return self.reader.stats.bytes_read

    def is_expert_tensor(self, name: str) -> bool:
        return self._expert_re.match(name) is not None

    def locate(self, layer: int, expert: int) -> list[PartLocation]:
        key = (layer, expert)
        locs = self._loc_cache.get(key)
        if locs is None:
            locs = [loc for p in self.parts if (loc := self._locate_part(p, layer, expert)) is not None]
            self._loc_cache[key] = locs
        return locs

    def _locate_part(self, part: PartSpec, layer: int, expert: int) -> PartLocation | None:
        name = self.prefix + part.tensor.format(layer=layer, expert=expert)
        if name not in self.index:
            if part.optional:
                return None
            raise CheckpointError(f"{self.index.root}: expert tensor {name!r} is missing")
        info = self.index[name]
        if part.fused and (not info.shape or info.shape[0] != self.num_experts):
            raise CheckpointError(f"{name}: fused expert tensor has shape {list(info.shape)}, "
                                  f"expected {self.num_experts} experts along dim 0")
        pieces = self.index.pieces.get(name)
        if pieces is not None:  # packed: the expert's slice is a piece of one checksummed range
            pc = pieces[expert if part.fused else 0]
            return PartLocation(part.name, pc.file, pc.offset, pc.nbytes, info.dtype,
                                info.shape[1:] if part.fused else info.shape, pc.group, info.codec)
        if not part.fused:
            return PartLocation(part.name, info.file, info.offset, info.nbytes, info.dtype, info.shape)
        stride = info.nbytes // self.num_experts
        return PartLocation(part.name, info.file, info.offset + expert * stride, stride, info.dtype, info.shape[1:])

    def check_uniform(self, layers: list[int]) -> None:
        """Every expert of every MoE layer has the parts, dtypes and shapes of the first one: kernels (the native
        grouped MXFP4 path above all) size their reads from one expert, so a malformed expert must fail here."""
        if not layers:
            return
        want = [(loc.name, loc.dtype, loc.shape) for loc in self.locate(layers[0], 0)]
        for layer in layers:
            for expert in range(self.num_experts):
                got = [(loc.name, loc.dtype, loc.shape) for loc in self.locate(layer, expert)]
                if got != want:
                    bad = next((g, w) for g, w in zip(got + [None] * len(want), want + [None] * len(got)) if g != w)
                    raise CheckpointError(
                        f"{self.index.root}: layer {layer} expert {expert} does not match the others: part "
                        f"{_part(bad[0])} where expert 0 of layer {layers[0]} has {_part(bad[1])}")

    def named_parts(self, layer: int, expert: int) -> list[tuple[str, bool, PartLocation]]:
        """(checkpoint tensor name, fused, location) of each part of one expert (what `moestream pack` copies)."""
        out = []
        for p in self.parts:
            loc = self._locate_part(p, layer, expert)
            if loc is not None:
                out.append((self.prefix + p.tensor.format(layer=layer, expert=expert), p.fused, loc))
        return out

    def read_plan(self, layer: int, expert: int) -> tuple[ReadPlan, list[tuple[str, int, PartLocation]]]:
        """The aligned, coalesced reads of one expert and where each part lands in its buffer (memoised). A packed
        expert is a single span (one read) whose checksum is remembered for `read` / `submit`."""
        key = (layer, expert)
        got = self._plans.get(key)
        if got is None:
            locs = self.locate(layer, expert)
            groups = {loc.group for loc in locs}
            if locs and len(groups) == 1 and -1 not in groups:
                pe = self.index.packed[locs[0].group]
                rp = plan_reads([Span(pe.file, pe.offset, pe.nbytes)])
                base = rp.starts[0]
                self._checks[key] = Check(base, pe)
                got = (rp, [(loc.name, base + loc.offset - pe.offset, loc) for loc in locs])
            else:
                rp = plan_reads([Span(loc.file, loc.offset, loc.nbytes) for loc in locs])
                got = (rp, [(loc.name, start, loc) for loc, start in zip(locs, rp.starts)])
            self._plans[key] = got
            layout = part_layout(got[1])
            self._layouts[key] = self._layout_ids.setdefault(layout, layout)
        return got

    def _checked(self, key: tuple[int, int], buf, parts) -> ExpertBlob:
        """The blob of a finished read, after its crc32 (packed experts, unless verification is off)."""
        check = self._checks.get(key)
        if check is not None and self.verify:
            pe = check.packed
            t = time.perf_counter()
            got = crc32(memoryview(buf)[check.start:check.start + pe.nbytes])  # releases the GIL
            with self._check_lock:
                self.checksum_s += time.perf_counter() - t
                self.checksum_bytes += pe.nbytes
            if got != pe.crc32:
                self.reader.pool.give(buf)
                raise CheckpointError(
                    f"{pe.file}: layer {key[0]} expert {key[1]} fails its checksum (crc32 {got:08x}, manifest "
                    f"{pe.crc32:08x}, {pe.nbytes} bytes at offset {pe.offset}): the packed checkpoint is damaged; "
                    f"`moestream pack --verify DIR` lists every bad expert, pack the original again")
        for name, start, loc in parts:  # a coded part's layout, before any kernel reads it (its crc cannot say)
            if loc.codec == "b12":
                try:
                    b12.check_bytes(bytes_to_tensor(memoryview(buf)[start:start + loc.nbytes], "U8", (loc.nbytes,)),
                                    *loc.shape)
                except ValueError as e:
                    self.reader.pool.give(buf)
                    raise CheckpointError(f"{loc.file}: layer {key[0]} expert {key[1]} part {name!r}: {e}; the packed "
                                          f"checkpoint is damaged, pack the original again") from None
        layout = self._layouts[key]
        kept = self.reader.pool.claim(buf)  # (layout, views) the buffer's last expert left on it
        return ExpertBlob(buf, parts, layout, kept[1] if kept is not None and kept[0] is layout else None)

    def expert_nbytes(self, layer: int, expert: int) -> int:
        """Bytes of one expert's tensors in the checkpoint."""
        return sum(loc.nbytes for loc in self.locate(layer, expert))

    def resident_nbytes(self, layer: int, expert: int) -> int:
        """What one expert costs in RAM: its buffer, including alignment padding and read-through holes."""
        return self.read_plan(layer, expert)[0].nbytes

    def read(self, layer: int, expert: int) -> ExpertBlob:
        """One expert into one aligned buffer, blocking."""
        return self.submit(layer, expert).result()

    def submit(self, layer: int, expert: int, priority: int = DEMAND) -> Future:
        """Queue one expert's read on the I/O threads (reader.DEMAND before reader.AHEAD); the future yields its
        ExpertBlob. `reader.cancel` / `reader.promote` act on it while it waits."""
        rp, parts = self.read_plan(layer, expert)
        return self.reader.submit(rp, priority, then=lambda buf: self._checked((layer, expert), buf, parts))

    def fill_hook(self) -> Callable[[list[tuple[int, list[int]]]], None] | None:
        """For a remote checkpoint with an SSD tier: a function taking the lookahead's predictions [(layer, experts
        best first)] whose bytes are then fetched into that tier ahead of need (weights/fetchahead.py); None
        otherwise (a local disk needs no fetch-ahead)."""
        fill = getattr(self.index, "fill_ahead", None)
        if fill is None:
            return None
        return lambda preds: fill([(r.file, r.start, r.length) for layer, experts in preds for e in experts
                                   for r in self.read_plan(layer, e)[0].runs])

    def read_many(self, keys: list[tuple[int, int]]) -> list[ExpertBlob]:
        futures = [self.submit(*k) for k in keys]
        return [f.result() for f in futures]

    def recycle(self, blob: ExpertBlob) -> None:
        """An evicted expert's buffer goes back to the pool; nothing may use its tensors afterwards."""
        views, blob._views = blob._views, None
        # its views go back with the buffer: the next expert of the same layout read into it uses them again (a
        # view costs ~5 us to make; a scanning batch step makes ~3,000)
        self.reader.pool.give(blob.buf, None if views is None or blob.layout is None else (blob.layout, views))

    def close(self) -> None:
        self.reader.close()
        close = getattr(self.index, "close", None)  # a remote index writes what it fetched to its SSD tier
        if close is not None:
            close()


def _part(p: tuple | None) -> str:
    return "(none)" if p is None else f"{p[0]} {p[1]}{list(p[2])}"


def fp32_nbytes(loc: PartLocation) -> int:
    """Bytes of the part once expanded to fp32 for compute (scratch sizing)."""
    if loc.codec is not None:
        return 4 * math.prod(loc.shape)
    numel = loc.nbytes // DTYPES[loc.dtype][1]
    return numel * 4


def _view(mv: memoryview, loc: PartLocation) -> torch.Tensor:
    """A part's zero-copy tensor: its dtype and shape, or a B12Weight over a b12-coded part's bytes."""
    if loc.codec == "b12":
        return B12Weight.wrap(bytes_to_tensor(mv, "U8", (len(mv),)), loc.shape)
    return bytes_to_tensor(mv, loc.dtype, loc.shape)
