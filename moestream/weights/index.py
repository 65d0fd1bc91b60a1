"""Checkpoint index: reads safetensors headers (never tensor data) into name -> (file, offset, length, dtype, shape).

Owns header parsing and validation (truncated or corrupt shards are caught here, at open) and the positioned
read of one tensor into a torch tensor. A directory written by `moestream pack` (a `moestream-pack.json`
manifest, docs/pack.md) opens here too: its dense shards are ordinary safetensors, and each expert tensor keeps
its original name, dtype and shape but lives as pieces (`pieces`), one per expert, inside checksummed contiguous
ranges (`packed`). It does not cache anything and does not know about experts or models.
Peak memory: the JSON headers (and the pack manifest) only.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.errors import CheckpointError
from moestream.kernels import b12
from moestream.weights import pages
from moestream.weights.crc import crc32
from moestream.weights.validate import (check_align, check_no_overlap, header_entry, is_int, member_file,
                                       regular_file)

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
PACK_MANIFEST = "moestream-pack.json"  # marks a directory written by `moestream pack`
PACK_FORMAT, PACK_VERSION = "moestream-pack", 1
REMOTE_MANIFEST = "moestream-remote.json"  # marks the local stub of a remote checkpoint (weights/remote.py)

ALIGN = 4096  # O_DIRECT needs block-aligned offsets, lengths and addresses; 4 KiB covers every common device


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    # "b12" when the bytes hold kernels/b12.py's coding, either form (b12 or b12x, with exceptions): a packed expert
    # tensor's pieces (nbytes: the bf16 size), or
    # a packed dense matrix (dense_codec in the manifest; nbytes: the coded bytes stored, dtype and shape the bf16's)
    codec: str | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


@dataclass(frozen=True)
class PackedExpert:
    """One expert of a packed checkpoint: `nbytes` contiguous bytes at a 4 KiB-aligned `offset`, with a crc32."""

    layer: int
    expert: int
    file: Path
    offset: int
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class Piece:
    """Where one expert's slice of a packed tensor lives; `group` indexes CheckpointIndex.packed."""

    file: Path
    offset: int
    nbytes: int
    group: int


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
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read safetensors header: {type(e).__name__}: {e}") from None
    return tensors_from_header(path, raw, size)


def tensors_from_header(where, raw: bytes, size: int) -> dict[str, TensorInfo]:
    """The tensors of one shard's safetensors header, validated: `raw` is the JSON after the 8-byte length, `size`
    the whole file's length, `where` the path (or remote file object) TensorInfo.file will hold."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{where}: cannot read safetensors header: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: safetensors header is not a JSON object")
    base = 8 + len(raw)
    out: dict[str, TensorInfo] = {}
    itemsizes = {k: v[1] for k, v in DTYPES.items()}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = header_entry(where, name, meta, itemsizes)
        if base + end > size:
            raise CheckpointError(
                f"{where}: truncated: tensor {name!r} ends at byte {base + end} but the file has {size} bytes")
        out[name] = TensorInfo(name, where, base + begin, end - begin, dtype, shape)
    check_no_overlap(where, [(t.offset, t.offset + t.nbytes, n) for n, t in out.items()])
    return out


class CheckpointIndex:
    """All tensors of a checkpoint directory (single file or shards with model.safetensors.index.json)."""

    def __init__(self, root: Path, tensors: dict[str, TensorInfo], virtual: bool = False,
                 packed: list[PackedExpert] | None = None, pieces: dict[str, tuple[Piece, ...]] | None = None,
                 crcs: dict[str, int] | None = None):
        self.root = root
        self.tensors = tensors
        self.virtual = virtual  # built from a family's inventory: sizes only, no data to read
        # packed checkpoints only: the checksummed expert ranges, each packed tensor's pieces along dim 0 (one
        # piece for a per-expert tensor), and the crc32 of every dense tensor
        self.packed: list[PackedExpert] = packed or []
        self.pieces: dict[str, tuple[Piece, ...]] = pieces or {}
        self.crcs: dict[str, int] = crcs or {}

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
        return (root / "model.safetensors.index.json").exists() or (root / PACK_MANIFEST).exists() \
            or (root / REMOTE_MANIFEST).exists() or any(root.glob("*.safetensors"))

    @classmethod
    def open(cls, root: str | Path) -> "CheckpointIndex":
        root = Path(root)
        if not root.is_dir():
            raise CheckpointError(f"{root}: not a checkpoint directory")
        if (root / PACK_MANIFEST).exists():
            return _open_packed(cls, root)
        if (root / REMOTE_MANIFEST).exists():
            from moestream.weights.remote import open_remote_index
            return open_remote_index(root)
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
        """Read one whole tensor with a positioned read (the OS page cache is dropped afterwards). A packed
        expert tensor is gathered from its pieces; a packed dense tensor is checked against its crc32."""
        info = self[name]
        pieces = self.pieces.get(name)
        if pieces is not None and info.codec is not None:  # b12: each piece decoded to its bf16 slice
            out = torch.empty(info.shape, dtype=torch.bfloat16)
            rows = out.view(len(pieces), *info.shape[-2:])
            for i, piece in enumerate(pieces):
                coded = torch.frombuffer(read_range(piece.file, piece.offset, piece.nbytes), dtype=torch.uint8)
                rows[i] = b12.decode(coded, *info.shape[-2:])
            return out
        if info.codec is not None and pieces is None:  # a coded dense matrix: its bytes, read by the kernels
            buf = read_range(info.file, info.offset, info.nbytes, out=pages.weight_bytes(info.nbytes))
            self._check_dense(name, info, buf)
            data = torch.frombuffer(buf, dtype=torch.uint8)
            try:  # its rows stored whole and its exceptions' table, checked before any kernel reads them
                b12.check_bytes(data, *info.shape)
            except ValueError as e:
                raise CheckpointError(f"{info.file}: tensor {name!r}: {e}") from None
            return b12.B12Weight.wrap(data, info.shape)
        if pieces is not None:
            buf, at = bytearray(info.nbytes), 0
            for piece in pieces:
                read_range(piece.file, piece.offset, piece.nbytes, memoryview(buf)[at:at + piece.nbytes])
                at += piece.nbytes
        else:
            buf = read_range(info.file, info.offset, info.nbytes, out=pages.weight_bytes(info.nbytes))
            self._check_dense(name, info, buf)
        return bytes_to_tensor(buf, info.dtype, info.shape)

    def _check_dense(self, name: str, info: TensorInfo, buf) -> None:
        want = self.crcs.get(name)
        if want is not None and crc32(buf) != want:
            raise CheckpointError(f"{info.file}: tensor {name!r} fails its checksum (crc32 {crc32(buf):08x}, "
                                  f"manifest {want:08x}): the packed checkpoint is damaged; pack it again")


def _shard_files(root: Path) -> list[Path]:
    """The shards to open: those the index's weight_map names (each inside `root`, a regular file), else every
    *.safetensors file."""
    idx = root / "model.safetensors.index.json"
    if idx.exists():
        try:
            weight_map = json.loads(idx.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError) as e:
            raise CheckpointError(f"{idx}: malformed index: {type(e).__name__}: {e}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{idx}: malformed index: weight_map is not a JSON object")
        names = set()
        for tensor, name in weight_map.items():
            if not isinstance(name, str):
                raise CheckpointError(f"{idx}: weight_map entry for tensor {tensor!r} is {name!r}, not a file name")
            names.add(name)
        return [member_file(root, name, idx.name) for name in sorted(names)]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files found")
    return [regular_file(root, f, "safetensors shard") for f in files]


def _open_packed(cls, root: Path) -> CheckpointIndex:
    """A directory written by `moestream pack`: dense tensors from ordinary safetensors shards, expert tensors
    from the manifest (same names, dtypes and shapes as the source), every range checked against file sizes."""
    path = root / PACK_MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: cannot read the pack manifest: {type(e).__name__}: {e}") from None
    if not isinstance(m, dict) or m.get("format") != PACK_FORMAT:
        raise CheckpointError(f"{path}: not a moestream pack manifest")
    if m.get("version") != PACK_VERSION:
        raise CheckpointError(f"{path}: pack format version {m.get('version')!r} is not supported (this moestream "
                              f"reads version {PACK_VERSION}); pack the original checkpoint again")
    try:
        return _packed_index(cls, root, m)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CheckpointError(f"{path}: malformed pack manifest ({type(e).__name__}: {e})") from None


def _coded_max(shape: tuple[int, int], codec: str) -> int:
    """The most bytes a coded matrix (dense, or one expert's piece) takes: every row stored whole, and with
    exceptions (b12x) the table of the most a row may keep besides (a row keeps at most a quarter of its values)."""
    n, k = shape
    return b12.coded_nbytes(n, k, n, n * (k // 4) if codec == "b12x" else 0)


def _packed_index(cls, root: Path, m: dict) -> CheckpointIndex:
    tensors: dict[str, TensorInfo] = {}
    for name in m["dense_files"]:
        tensors.update(_read_header(member_file(root, name, f"{PACK_MANIFEST} dense shard")))
    crcs = {str(k): int(v) for k, v in m.get("dense_crc32", {}).items()}
    for name, c in m.get("dense_codec", {}).items():  # coded dense matrices: stored U8, presented as the bf16 matrix
        t, shape = tensors.get(name), tuple(_count(s, f"tensor {name!r} shape") for s in c["shape"])
        if t is None or t.dtype != "U8" or c["codec"] not in ("b12", "b12x") or c["dtype"] != "BF16" \
                or not b12.supported(shape, torch.bfloat16) \
                or not b12.coded_nbytes(*shape, 0) <= t.nbytes <= _coded_max(shape, c["codec"]):
            raise CheckpointError(f"{root}: coded dense tensor {name!r} ({c['codec']} {c['dtype']}{list(shape)}) "
                                  f"does not match its bytes in the dense shards")
        tensors[name] = TensorInfo(name, t.file, t.offset, t.nbytes, "BF16", shape, "b12")
    sizes: dict[str, int] = {}
    for name in m["expert_files"]:
        sizes[name] = member_file(root, name, f"{PACK_MANIFEST} expert file").stat().st_size
    align = check_align(root / PACK_MANIFEST, m.get("align", 4096))
    meta = {name: (str(t["dtype"]), tuple(_count(s, f"tensor {name!r} shape") for s in t["shape"]), bool(t["fused"]))
            for name, t in m["tensors"].items()}
    codecs = {name: t.get("codec") for name, t in m["tensors"].items()}
    packed: list[PackedExpert] = []
    slots: dict[str, dict[int, Piece]] = {name: {} for name in meta}
    for rec in m["experts"]:
        fname, off, n = str(rec["file"]), _count(rec["offset"], "offset"), _count(rec["length"], "length")
        where = f"{root / fname}: layer {rec['layer']} expert {rec['expert']}"
        if fname not in sizes:
            raise CheckpointError(f"{where}: file is not listed in {PACK_MANIFEST}")
        if off % align or off < 0:
            raise CheckpointError(f"{where}: offset {off} is not {align}-byte aligned")
        if off + n > sizes[fname]:
            raise CheckpointError(f"{where}: truncated: the expert ends at byte {off + n} but the file has "
                                  f"{sizes[fname]} bytes")
        group = len(packed)
        packed.append(PackedExpert(int(rec["layer"]), int(rec["expert"]), root / fname, off, n, int(rec["crc32"])))
        for part in rec["parts"]:
            tname, at, nb = str(part["tensor"]), _count(part["offset"], "offset"), _count(part["nbytes"], "nbytes")
            if tname not in meta or at < 0 or at + nb > n:
                raise CheckpointError(f"{where}: part {tname!r} lies outside the expert or names an unknown tensor")
            slot = 0 if part.get("index") is None else _count(part["index"], "index")
            if slot in slots[tname]:
                raise CheckpointError(f"{where}: tensor {tname!r} slice {slot} is packed twice")
            slots[tname][slot] = Piece(root / fname, off + at, nb, group)
    pieces: dict[str, tuple[Piece, ...]] = {}
    for name, (dtype, shape, fused) in meta.items():
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * DTYPES[dtype][1] if dtype in DTYPES else -1
        count = shape[0] if fused and shape else 1
        got = slots[name]
        codec = codecs[name]
        if codec is not None:  # b12 pieces: each between the coded size with no row and with every row stored whole
            piece = shape[1:] if fused else shape  # (b12x: and the table of the most exceptions its rows may keep)
            sizes_ok = (codec in ("b12", "b12x") and b12.supported(piece, DTYPES.get(dtype, (None,))[0])
                        and all(b12.coded_nbytes(*piece, 0) <= p.nbytes <= _coded_max(piece, codec)
                                for p in got.values()))
        else:
            sizes_ok = sum(p.nbytes for p in got.values()) == nbytes and len({p.nbytes for p in got.values()}) <= 1
        if dtype not in DTYPES or len(got) != count or sorted(got) != list(range(count)) or not sizes_ok:
            raise CheckpointError(f"{root}: packed tensor {name!r} ({dtype}{list(shape)}"
                                  f"{', ' + str(codec) if codec else ''}) is not fully described "
                                  f"by its {len(got)} pieces in {PACK_MANIFEST}")
        if name in tensors:
            raise CheckpointError(f"{root}: tensor {name!r} is both dense and packed")
        pieces[name] = tuple(got[i] for i in range(count))
        first = pieces[name][0]
        # "b12" for either form: the kernels read both, a piece's base bytes saying which rows keep exceptions
        tensors[name] = TensorInfo(name, first.file, first.offset, nbytes, dtype, shape, codec and "b12")
    return cls(root, tensors, packed=packed, pieces=pieces, crcs=crcs)


def _count(v: object, what: str) -> int:
    """A non-negative integer field of the pack manifest (ValueError is reported as a malformed manifest)."""
    if not is_int(v) or v < 0:
        raise ValueError(f"{what} {v!r} is not a non-negative integer")
    return v


def bytes_to_tensor(buf: bytearray | memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch view over raw little-endian bytes (no copy)."""
    if len(buf) == 0:
        return torch.empty(shape, dtype=DTYPES[dtype][0])
    return torch.frombuffer(buf, dtype=DTYPES[dtype][0]).view(shape)


def pread_fill(fd: int, views: list[memoryview], offset: int) -> tuple[int, int]:
    """preadv from `offset` into consecutive buffers, resuming partial reads, until they are full or the file
    ends. Returns (bytes read, preadv calls); the caller decides whether a short read is an error."""
    views = [v for v in views if len(v)]
    done = calls = 0
    while views:
        n = os.preadv(fd, views, offset + done)
        calls += 1
        if n <= 0:
            break
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return done, calls


def read_into(path: Path, offset: int, buffers: list) -> None:
    """Fill `buffers` (consecutive) from [offset, ...) of `path` with one scatter read; CheckpointError if the file
    ends first; the pages are dropped afterwards."""
    views = [memoryview(b).cast("B") for b in buffers]
    if not isinstance(path, (str, Path)):  # a remote shard (weights/remote.py) reads through HTTP and the SSD tier
        path.read_into(offset, views)
        return
    nbytes = sum(len(v) for v in views)
    fd = os.open(path, os.O_RDONLY)
    try:
        done, _ = pread_fill(fd, views, offset)
        if done < nbytes:
            raise CheckpointError(f"{path}: unexpected end of file at byte {offset + done}")
        drop_pages(fd, offset, nbytes)
    finally:
        os.close(fd)


def read_range(path: Path, offset: int, nbytes: int, out=None) -> bytearray:
    """Positioned read of [offset, offset+nbytes) into a fresh bytearray (or `out`, any writable buffer of at least
    nbytes: a dense weight's `pages.weight_bytes`); drops the pages afterwards. Returns the buffer."""
    buf = out if out is not None else bytearray(nbytes)
    read_into(path, offset, [memoryview(buf)[:nbytes]])
    return buf


def drop_pages(fd: int, offset: int, nbytes: int) -> None:
    """Evict [offset, offset + nbytes) of an open file from the OS page cache (no-op where unsupported)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def drop_file_pages(path: Path) -> bool:
    """Evict a whole file from the OS page cache; False where the OS cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_pages(fd, 0, 0)
    finally:
        os.close(fd)
    return True
