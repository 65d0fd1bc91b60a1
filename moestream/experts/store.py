"""Expert store: where a routed expert's bytes live in the checkpoint and how to read them.

Owns the mapping (layer, expert) -> byte ranges in the shards, for checkpoints that store one tensor per expert
and for fused per-layer tensors (an expert is then a contiguous slice along dim 0), and the positioned reads
that fill one buffer per expert. It does not decide residency (cache.py) or compute (kernels/).
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moestream.errors import CheckpointError
from moestream.weights.index import DTYPES, CheckpointIndex, bytes_to_tensor, read_range


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

    def __init__(self, buf: bytearray, parts: list[tuple[str, int, PartLocation]]):
        self.buf = buf
        self.parts = parts
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
                 io_threads: int = 8):
        self.index = index
        self.parts = parts
        self.prefix = prefix
        self.num_experts = num_experts
        self._pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="moestream-io")
        self._loc_cache: dict[tuple[int, int], list[PartLocation]] = {}
        self.bytes_read = 0

    def is_expert_tensor(self, name: str) -> bool:
        return any(p.pattern(self.prefix).match(name) for p in self.parts)

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

    def expert_nbytes(self, layer: int, expert: int) -> int:
        return sum(loc.nbytes for loc in self.locate(layer, expert))

    def read(self, layer: int, expert: int) -> ExpertBlob:
        """One expert into one buffer; ranges adjacent in the same file are read with one call."""
        locs = self.locate(layer, expert)
        buf = bytearray(sum(loc.nbytes for loc in locs))
        parts, off = [], 0
        for loc in locs:
            parts.append((loc.name, off, loc))
            off += loc.nbytes
        for file, start, length, dst in _coalesce(parts):
            read_range(file, start, length, memoryview(buf)[dst:dst + length])
        self.bytes_read += len(buf)
        return ExpertBlob(buf, parts)

    def read_many(self, keys: list[tuple[int, int]]) -> list[ExpertBlob]:
        if len(keys) <= 1:
            return [self.read(*k) for k in keys]
        return list(self._pool.map(lambda k: self.read(*k), keys))

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _coalesce(parts: list[tuple[str, int, PartLocation]]) -> list[tuple[object, int, int, int]]:
    """Merge parts that are adjacent both in the file and in the buffer into single reads."""
    runs: list[list] = []
    for _, dst, loc in parts:
        if runs and runs[-1][0] == loc.file and runs[-1][1] + runs[-1][2] == loc.offset \
                and runs[-1][3] + runs[-1][2] == dst:
            runs[-1][2] += loc.nbytes
        else:
            runs.append([loc.file, loc.offset, loc.nbytes, dst])
    return [tuple(r) for r in runs]


def fp32_nbytes(loc: PartLocation) -> int:
    """Bytes of the part once expanded to fp32 for compute (scratch sizing)."""
    numel = loc.nbytes // DTYPES[loc.dtype][1]
    return numel * 4
