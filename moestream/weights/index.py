"""Checkpoint index: reads safetensors headers (never tensor data) into name -> (file, offset, length, dtype, shape).

Owns header parsing and validation (truncated or corrupt shards are caught here, at open) and the positioned
read of one tensor into a torch tensor. It does not cache anything and does not know about experts or models.
Peak memory: the JSON headers only.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.errors import CheckpointError

# safetensors dtype string -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise CheckpointError(f"{path}: corrupt safetensors header length {hlen} (file is {size} bytes)")
            header = json.loads(f.read(hlen))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    base = 8 + hlen
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor_info(path, name, meta, base, size)
    return out


def _tensor_info(path: Path, name: str, meta: dict, base: int, size: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
    if dtype not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
    numel = 1
    for s in shape:
        numel *= s
    if end - begin != numel * DTYPES[dtype][1] or begin < 0:
        raise CheckpointError(f"{path}: tensor {name!r} byte range [{begin}, {end}) does not match {dtype}{list(shape)}")
    if base + end > size:
        raise CheckpointError(
            f"{path}: truncated: tensor {name!r} ends at byte {base + end} but the file has {size} bytes"
        )
    return TensorInfo(name, path, base + begin, end - begin, dtype, shape)


class CheckpointIndex:
    """All tensors of a checkpoint directory (single file or shards with model.safetensors.index.json)."""

    def __init__(self, root: Path, tensors: dict[str, TensorInfo], virtual: bool = False):
        self.root = root
        self.tensors = tensors
        self.virtual = virtual  # built from a family's inventory: sizes only, no data to read

    @classmethod
    def virtual_from(cls, root: str | Path, inventory: dict[str, tuple[tuple[int, ...], str]]) -> "CheckpointIndex":
        """An index of the tensors a config implies (for `info` on a directory holding only config.json)."""
        tensors, offset, where = {}, 0, Path(root) / "(config only)"
        for name, (shape, dtype) in inventory.items():
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * DTYPES[dtype][1]
            tensors[name] = TensorInfo(name, where, offset, nbytes, dtype, tuple(shape))
            offset += nbytes
        return cls(Path(root), tensors, virtual=True)

    @staticmethod
    def has_weights(root: str | Path) -> bool:
        root = Path(root)
        return (root / "model.safetensors.index.json").exists() or any(root.glob("*.safetensors"))

    @classmethod
    def open(cls, root: str | Path) -> "CheckpointIndex":
        root = Path(root)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a checkpoint directory")
        files = _shard_files(root)
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            tensors.update(_read_header(f))
        return cls(root, tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: tensor {name!r} is missing from the checkpoint") from None

    def names(self) -> list[str]:
        return list(self.tensors)

    def load(self, name: str) -> torch.Tensor:
        """Read one whole tensor with a positioned read (the OS page cache is dropped afterwards)."""
        info = self[name]
        buf = read_range(info.file, info.offset, info.nbytes)
        return bytes_to_tensor(buf, info.dtype, info.shape)


def _shard_files(root: Path) -> list[Path]:
    idx = root / "model.safetensors.index.json"
    if idx.exists():
        try:
            weight_map = json.loads(idx.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{idx}: malformed index: {e}") from None
        files = sorted({root / f for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{root}: shards named in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files found")
    return files


def bytes_to_tensor(buf: bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch view over raw little-endian bytes (no copy)."""
    if len(buf) == 0:
        return torch.empty(shape, dtype=DTYPES[dtype][0])
    return torch.frombuffer(buf, dtype=DTYPES[dtype][0]).view(shape)


def read_range(path: Path, offset: int, nbytes: int, out: bytearray | None = None) -> bytearray:
    """Positioned read of [offset, offset+nbytes) into a fresh (or given) buffer; drops the pages afterwards."""
    buf = out if out is not None else bytearray(nbytes)
    view = memoryview(buf)[:nbytes]
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{path}: unexpected end of file at byte {offset + done}")
            done += n
        _drop_pages(fd, offset, nbytes)
    finally:
        os.close(fd)
    return buf


def _drop_pages(fd: int, offset: int, nbytes: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
