"""Safetensors shards written straight from tensor specs, one bounded chunk at a time.

Owns the shard plan (specs cut into shards of about `shard_bytes`), each shard's header (computed from shapes and
dtypes before any value exists) and the chunked writing of values: a tensor larger than CHUNK_ELEMENTS is made
and written in row blocks, so peak memory is one chunk whatever the checkpoint's size (a 19 GB full-width
checkpoint writes in well under 1 GB of RSS). Written ranges are flushed and dropped from the page cache as they
go, so writing a large checkpoint does not evict everyone else's cached files either.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Callable, Iterator

import torch

from moestream.synth.families import TensorSpec

CHUNK_ELEMENTS = 16 << 20  # values made at once: 64 MiB of fp32 maths, 128 MiB of int64 codes at most
SYNC_BYTES = 256 << 20  # flush and drop written pages from the cache this often
ROW_MULTIPLE = 128  # chunks keep whole 128-row blocks, so a block-FP8 tile's codes come from one chunk
DEFAULT_DTYPE = torch.bfloat16
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8",
                      torch.int32: "I32", torch.int64: "I64", torch.float8_e4m3fn: "F8_E4M3"}

Init = Callable[[TensorSpec, int], Iterator[torch.Tensor]]


def dtype_of(spec: TensorSpec) -> torch.dtype:
    return spec.dtype or DEFAULT_DTYPE


def nbytes(spec: TensorSpec) -> int:
    return spec.numel * torch.empty((), dtype=dtype_of(spec)).element_size()


def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive specs grouped into shards: a shard closes before the tensor that would take it past
    `shard_bytes` (a tensor larger than that gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        n = nbytes(spec)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return [s for s in shards if s]


def header(specs: list[TensorSpec]) -> bytes:
    """The safetensors header for `specs` laid out in order, padded with spaces to 8 bytes (as safetensors does)."""
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        n = nbytes(spec)
        entries[spec.name] = {"dtype": SAFETENSORS_DTYPES[dtype_of(spec)], "shape": list(spec.shape),
                              "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def chunk_rows(spec: TensorSpec) -> int:
    """Rows of dim 0 made at once: all of them for a small tensor, else whole 128-row blocks (a 2-D linear: FP8
    tiles) or as many dim-0 slices as fit (fused experts [E, ...]: one expert can be 8 MB) under the limit."""
    if len(spec.shape) < 2 or spec.numel <= CHUNK_ELEMENTS:
        return spec.shape[0] if spec.shape else 1
    row = spec.numel // spec.shape[0]
    multiple = ROW_MULTIPLE if len(spec.shape) == 2 else 1
    return max(multiple, CHUNK_ELEMENTS // row // multiple * multiple)


def chunk_seed(spec: TensorSpec, seed: int, index: int) -> int:
    """Chunk 0 has the whole tensor's seed (small tensors are what they always were); later chunks their own."""
    base = seed * 1_000_003 + zlib.crc32(spec.name.encode())
    return base if index == 0 else base + 7919 * index


class ShardStream:
    """Writes one shard file: header first, then each tensor's chunks as they are made."""

    def __init__(self, path: Path, progress=None):
        self.path, self.progress = path, progress
        self.fd = -1
        self.unsynced = 0
        self.synced_to = 0

    def write(self, specs: list[TensorSpec], make: Init, seed: int) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self._put(header(specs))
            for spec in specs:
                for chunk in make(spec, seed):
                    self._put(_raw_bytes(chunk.to(dtype_of(spec))))
            self._sync()
        finally:
            os.close(self.fd)

    def _put(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        self.unsynced += len(data)
        if self.progress is not None:
            self.progress.update(len(data))
        if self.unsynced >= SYNC_BYTES:
            self._sync()

    def _sync(self) -> None:
        """Flush what was written and drop it from the page cache (written pages are not ours to keep)."""
        end = self.synced_to + self.unsynced
        os.fdatasync(self.fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.synced_to, end - self.synced_to, os.POSIX_FADV_DONTNEED)
        self.synced_to, self.unsynced = end, 0


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def write_shards(out: Path, shards: list[list[TensorSpec]], make: Init, seed: int, progress=None) -> dict[str, str]:
    """Write every shard as model-0000i-of-0000n.safetensors; returns the weight map (tensor name -> file)."""
    n, weight_map = len(shards), {}
    for i, specs in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        ShardStream(out / name, progress).write(specs, make, seed)
        weight_map.update({s.name: name for s in specs})
    return weight_map
