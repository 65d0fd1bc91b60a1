"""Checkpoint input validation: safetensors header entries, and the file names a checkpoint's own JSON points at.

Owns the rules that keep a damaged or hostile checkpoint from reaching a read or a native kernel with a bad range:
integer, non-negative shapes; integer, ordered, non-overlapping data offsets that match dtype x shape and end inside
the file; shard and manifest names that stay inside the checkpoint directory and name regular files (a FIFO would
block the open forever). Every failure is a CheckpointError naming the file and the tensor or name at fault.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from moestream.errors import CheckpointError


def is_int(v: object) -> bool:
    """A JSON integer (bool is an int subclass in Python but not an integer in a header)."""
    return isinstance(v, int) and not isinstance(v, bool)


def header_entry(path: Path, name: str, meta: object,
                 itemsizes: dict[str, int]) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, every field type- and range-checked."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: header entry is not a JSON object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in itemsizes:
        raise CheckpointError(f"{where}: unsupported dtype {dtype!r} (supported: {', '.join(itemsizes)})")
    if not isinstance(shape, list) or not all(is_int(s) and s >= 0 for s in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not a pair of integers")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}) are negative or out of order")
    numel = 1
    for s in shape:
        numel *= s
    if end - begin != numel * itemsizes[dtype]:
        raise CheckpointError(f"{where}: byte range [{begin}, {end}) holds {end - begin} bytes but {dtype}{shape} "
                              f"needs {numel * itemsizes[dtype]}")
    return dtype, tuple(shape), begin, end


def check_no_overlap(path: Path, ranges: list[tuple[int, int, str]]) -> None:
    """Tensors' byte ranges (begin, end, name) must not overlap (two tensors sharing bytes is a corrupt header)."""
    last_end, last_name = 0, None
    for begin, end, name in sorted(ranges):
        if begin < last_end and end > begin:
            raise CheckpointError(f"{path}: tensor {name!r} bytes [{begin}, {end}) overlap tensor {last_name!r}")
        if end >= last_end:
            last_end, last_name = end, name


def member_file(root: Path, name: object, what: str) -> Path:
    """`root / name` for a file name read from the checkpoint's own JSON (an index's weight_map, a pack manifest):
    a relative path without `..` that stays inside `root` (symlinks included, except a Hugging Face hub cache
    snapshot's links into its `blobs/`) and names an existing regular file."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{root}: {what} names a file {name!r} that is not a file name")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckpointError(f"{root}: {what} names {name!r}, outside the checkpoint directory (absolute paths and "
                              "'..' are refused)")
    path = root / rel
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"{root}: {what} names {name}, which is missing")
    return regular_file(root, path, what)


def regular_file(root: Path, path: Path, what: str) -> Path:
    """`path` if it is a regular file whose real location lies inside `root` (or its hub cache's blobs)."""
    real, home = path.resolve(), root.resolve()
    allowed = [home]
    if home.parent.name == "snapshots":  # huggingface_hub cache: snapshots/<rev>/x -> ../../blobs/<hash>
        allowed.append(home.parent.parent / "blobs")
    if not any(real.is_relative_to(a) for a in allowed):
        raise CheckpointError(f"{path}: {what} is a link to {real}, outside the checkpoint directory")
    try:
        mode = os.stat(real).st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: {what} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: {what} is not a regular file (a FIFO, device or directory)")
    return path


def check_align(path: Path, align: object) -> int:
    """A pack manifest's alignment: a positive power-of-two integer."""
    if not is_int(align) or align <= 0 or align & (align - 1):
        raise CheckpointError(f"{path}: align {align!r} is not a positive power of two")
    return align
