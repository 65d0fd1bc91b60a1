"""Expert store: where a routed expert's bytes live in the checkpoint and how to read them.

Owns the mapping (layer, expert) -> byte ranges in the shards, for checkpoints that store one tensor per expert
and for fused per-layer tensors (an expert is then a contiguous slice along dim 0), and each expert's read plan
(reader.py does the aligned, coalesced, page-cache-free reads into one recycled buffer per expert). It does not
decide residency (cache.py) or compute (kernels/).
"""
from __future__ import annotations

import re
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from moestream.errors import CheckpointError
from moestream.experts.reader import ReadPlan, Reader, Span, plan_reads
from moestream.weights.index import DTYPES, CheckpointIndex, bytes_to_tensor


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


class ExpertBlob:
    """One expert's bytes in a single buffer; `tensors()` gives zero-copy torch views per part."""

    __slots__ = ("buf", "parts", "nbytes", "_views")

    def __init__(self, buf, parts: list[tuple[str, int, PartLocation]]):
        self.buf = buf  # mmap (page-aligned, recycled on eviction) or bytearray
        self.parts = parts  # (part name, offset in buf, location in the checkpoint)
        self.nbytes = len(buf)
        self._views: dict[str, torch.Tensor] | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            mv = memoryview(self.buf)
            self._views = {
                name: bytes_to_tensor(mv[off:off + loc.nbytes], loc.dtype, loc.shape) for name, off, loc in self.parts
            }
        return self._views


class ExpertStore:
    def __init__(self, index: CheckpointIndex, parts: list[PartSpec], num_experts: int, prefix: str = "",
                 io_threads: int = 8, direct_io: bool = True):
        self.index = index
        self.parts = parts
        self.prefix = prefix
        self.num_experts = num_experts
        self.reader = Reader(io_threads, direct_io)
        self._loc_cache: dict[tuple[int, int], list[PartLocation]] = {}
        self._expert_re = re.compile("|".join(f"(?:{p.pattern(prefix).pattern})" for p in parts) or "(?!)")
        self._plans: dict[tuple[int, int], tuple[ReadPlan, list[tuple[str, int, PartLocation]]]] = {}

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
        if not part.fused:
            return PartLocation(part.name, info.file, info.offset, info.nbytes, info.dtype, info.shape)
        if not info.shape or info.shape[0] != self.num_experts:
            raise CheckpointError(f"{name}: fused expert tensor has shape {list(info.shape)}, "
                                  f"expected {self.num_experts} experts along dim 0")
        stride = info.nbytes // self.num_experts
        return PartLocation(part.name, info.file, info.offset + expert * stride, stride, info.dtype, info.shape[1:])

    def read_plan(self, layer: int, expert: int) -> tuple[ReadPlan, list[tuple[str, int, PartLocation]]]:
        """The aligned, coalesced reads of one expert and where each part lands in its buffer (memoised)."""
        key = (layer, expert)
        got = self._plans.get(key)
        if got is None:
            locs = self.locate(layer, expert)
            rp = plan_reads([Span(loc.file, loc.offset, loc.nbytes) for loc in locs])
            got = self._plans[key] = (rp, [(loc.name, start, loc) for loc, start in zip(locs, rp.starts)])
        return got

    def expert_nbytes(self, layer: int, expert: int) -> int:
        """Bytes of one expert's tensors in the checkpoint."""
        return sum(loc.nbytes for loc in self.locate(layer, expert))

    def resident_nbytes(self, layer: int, expert: int) -> int:
        """What one expert costs in RAM: its buffer, including alignment padding and read-through holes."""
        return self.read_plan(layer, expert)[0].nbytes

    def read(self, layer: int, expert: int) -> ExpertBlob:
        """One expert into one aligned buffer, blocking."""
        rp, parts = self.read_plan(layer, expert)
        buf = self.reader.pool.take(rp.nbytes)
        try:
            self.reader.read_into(rp, buf)
        except BaseException:
            self.reader.pool.give(buf)
            raise
        return ExpertBlob(buf, parts)

    def submit(self, layer: int, expert: int) -> Future:
        """Start reading one expert on the I/O pool; the future yields its ExpertBlob."""
        rp, parts = self.read_plan(layer, expert)
        return _then(self.reader.submit(rp), lambda buf: ExpertBlob(buf, parts))

    def read_many(self, keys: list[tuple[int, int]]) -> list[ExpertBlob]:
        futures = [self.submit(*k) for k in keys]
        return [f.result() for f in futures]

    def recycle(self, blob: ExpertBlob) -> None:
        """An evicted expert's buffer goes back to the pool; nothing may use its tensors afterwards."""
        blob._views = None
        self.reader.pool.give(blob.buf)

    def close(self) -> None:
        self.reader.close()


def _then(fut: Future, fn) -> Future:
    """A future of fn(fut.result()), resolved in the I/O thread that completes `fut`."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(e)

    fut.add_done_callback(done)
    return out


def fp32_nbytes(loc: PartLocation) -> int:
    """Bytes of the part once expanded to fp32 for compute (scratch sizing)."""
    numel = loc.nbytes // DTYPES[loc.dtype][1]
    return numel * 4
