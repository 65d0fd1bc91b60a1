"""`moestream pack`: re-lay a checkpoint so every routed expert is one contiguous, 4 KiB-aligned, checksummed range.

Owns the packed layout (docs/pack.md): dense tensors in ordinary safetensors shards, experts in a few
`model-experts-*.safetensors` files (each a valid safetensors file whose single U8 blob holds the experts), and
the `moestream-pack.json` manifest: per (layer, expert) the file, offset, length and crc32, and each part's
original tensor name, slice, dtype, shape and offset within the expert. Fused [E, ...] tensors are split per
expert; the index (weights/index.py) presents them under their original names again, so families see the same
checkpoint. Packing streams chunk by chunk (memory stays at one copy buffer whatever the checkpoint size), writes
into a temporary directory beside DST and renames it into place, and copies every non-weight file as bytes
(no Python from the checkpoint is executed). `verify` re-reads a packed directory and checks every checksum.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moestream.errors import CheckpointError, MoestreamError
from moestream.kernels import b12
from moestream.weights.crc import crc32
from moestream.weights.index import (ALIGN, DTYPES, PACK_FORMAT, PACK_MANIFEST, PACK_VERSION, CheckpointIndex,
                                     TensorInfo, bytes_to_tensor, drop_file_pages, drop_pages, pread_fill)

# every expert starts on the reader's O_DIRECT boundary (weights/index.py: ALIGN), so it is read whole, no widening
PART_ALIGN = 64  # a part keeps the offset modulo 64 it had in the original's read buffer (see _lay_out)
CHUNK = 8 << 20  # copy buffer: the packer's only sizeable allocation
DENSE_SHARD_BYTES = 4 << 30
EXPERT_FILE_BYTES = 32 << 30
EXPERT_BLOB = "packed_experts"  # the one U8 tensor an expert file declares, so the file is valid safetensors
HEADER_BYTES = ALIGN  # an expert file's safetensors header, padded so the blob (and byte 4096) starts the data
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")

Progress = Callable[[int], None]


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass
class PartPlan:
    tensor: str
    index: int | None  # slice along dim 0 of a fused tensor; None for a per-expert tensor
    src: TensorInfo  # the source bytes of this part (file, offset, nbytes; dtype and shape of the slice)
    phase: int = 0  # where the part started, modulo PART_ALIGN, in the buffer the original's reader fills
    offset: int = 0  # within the expert
    coded: int = -1  # --codec b12: the part's coded size (kernels/b12.py); -1 when stored as it is
    exceptions: int = 0  # ... and its exceptions where the smaller form keeps some (b12x)

    @property
    def nbytes(self) -> int:
        return self.src.nbytes if self.coded < 0 else self.coded


@dataclass
class ExpertPlan:
    layer: int
    expert: int
    parts: list[PartPlan]
    file: int = 0
    offset: int = 0
    length: int = 0
    crc32: int = 0


@dataclass
class PackPlan:
    experts: list[ExpertPlan]
    tensors: dict[str, tuple[str, tuple[int, ...], bool]]  # packed tensor -> (dtype, shape, fused)
    dense_shards: list[list[TensorInfo]]
    expert_file_sizes: list[int] = field(default_factory=list)
    codec: str | None = None
    dense_codable: set[str] = field(default_factory=set)  # dense tensors a codec may code (_dense_codable)
    dense_coded: dict[str, int] = field(default_factory=dict)  # with a codec: dense tensor -> its coded size
    dense_exceptions: dict[str, int] = field(default_factory=dict)  # ... and its exceptions (b12x: b12.py), if any

    @property
    def coded_tensors(self) -> set[str]:
        return {p.tensor for e in self.experts for p in e.parts if p.coded >= 0}

    @property
    def dense_bytes(self) -> int:
        return sum(t.nbytes for s in self.dense_shards for t in s)

    @property
    def expert_bytes(self) -> int:
        return sum(p.src.nbytes for e in self.experts for p in e.parts)

    @property
    def payload_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes

    @property
    def disk_bytes(self) -> int:
        return self.dense_bytes + sum(self.expert_file_sizes) + (1 << 20)


@dataclass
class PackSummary:
    path: str
    experts: int
    expert_files: int
    dense_files: int
    dense_bytes: int
    expert_bytes: int  # payload of the experts (what the source held)
    disk_bytes: int  # every file written, alignment padding included
    verified: bool = False
    coded_bytes: int = 0  # with a codec: the experts' bytes as written
    dense_coded_bytes: int = 0  # with a codec: the coded dense tensors' bytes as written
    dense_coded_source: int = 0  # ... and as the source held them


def dense_name(i: int, n: int) -> str:
    return f"model-dense-{i + 1:05d}-of-{n:05d}.safetensors"


def expert_name(i: int, n: int) -> str:
    return f"model-experts-{i + 1:05d}-of-{n:05d}.safetensors"


# ---- planning (headers only) ------------------------------------------------------------------------------
def plan_pack(src: str | Path, dense_shard_bytes: int = DENSE_SHARD_BYTES,
              expert_file_bytes: int = EXPERT_FILE_BYTES) -> tuple[PackPlan, CheckpointIndex]:
    """Where every byte of `src` goes, from its config and headers (nothing is read or written). A coded pack
    (`pack(codec=...)`) sizes its coded parts afterwards (_size_coded) and lays the experts out again."""
    from moestream.engine.engine import plan  # the family's expert layout, exactly as the engine sees it

    p = plan(src, io_threads=1)
    try:
        index, store, layout = p.store.index, p.store, p.layout
        if index.virtual:
            raise CheckpointError(f"{src}: holds config.json but no safetensors weights; nothing to pack")
        experts: list[ExpertPlan] = []
        packed: dict[str, tuple[str, tuple[int, ...], bool]] = {}
        for layer in layout.moe_layers:
            for e in range(layout.num_experts):
                parts = []
                starts = [start for _, start, _ in store.read_plan(layer, e)[1]]
                for (name, fused, loc), start in zip(store.named_parts(layer, e), starts):
                    if loc.codec is not None:
                        raise MoestreamError(f"{src}: its experts are already coded ({loc.codec}); pack the original "
                                             f"checkpoint instead")
                    info = index[name]
                    packed[name] = (info.dtype, info.shape, fused)
                    parts.append(PartPlan(name, e if fused else None,
                                          TensorInfo(name, loc.file, loc.offset, loc.nbytes, loc.dtype, loc.shape),
                                          start % PART_ALIGN))
                if parts:
                    experts.append(ExpertPlan(layer, e, parts))
    finally:
        p.store.close()
    dense = sorted((index[n] for n in index.names() if n not in packed), key=lambda t: (str(t.file), t.offset))
    if any(t.codec is not None for t in dense):
        raise MoestreamError(f"{src}: its dense tensors are already coded ({next(t for t in dense if t.codec).codec});"
                             f" pack the original checkpoint instead")
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for t in dense:
        if shards[-1] and size + t.nbytes > dense_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    pp = PackPlan(experts, packed, shards if dense else [])
    pp.dense_codable = {t.name for t in dense if _dense_codable(t, p)}
    _lay_out(pp, expert_file_bytes)
    return pp, index


# Dense matrices `--codec b12` codes besides the experts: those every consumer multiplies through `blocks.linear` /
# `linear_many` or the one-call decode layer (which read the coded bytes): the untied lm_head of any family, the
# dense and shared-expert GLU MLPs (`{gate,up,down}_proj` under `mlp`, `mlp.shared_experts` or
# `block_sparse_moe.shared_experts`: models/base.py dense_glu, latent_moe's shared experts), and the attention
# projections of the GQA families and Kimi K3's attention and latent projections (CODED_K3). Others (MLA's kv_b
# fold, the other MLA / KDA families' attention, the embedding's row gathers, routers) stay bf16.
# A dense matrix (an expert tensor: over all of its experts) is stored coded only where that saves at least a tenth
# of its bytes. Wide rows of Gaussian-like values often hold a value 2^15 or more below their largest, which the
# row's codes cannot give: coded as experts are, the full-width synthetic K3's lm_head (7168 wide) had 60% of its rows
# stored whole (each costs its slot besides: 1.75x bf16), 1.35x its bf16 size. Dense matrices therefore keep such
# values as exceptions beside their row (b12.py's b12x form, the manifest's codec "b12x" where a matrix has any),
# and store a row whole only where its exceptions would take more than K bytes. Expert matrices are coded the same
# way, each in the smaller of the two forms (the peer model's 1024-wide experts: 6% of rows stored whole, 0.81x of
# their bf16 bytes, against 0.75x with exceptions); an expert tensor any of whose experts keeps exceptions is
# "b12x" in the manifest, and the reader checks each coded expert's layout after its read (b12.check_bytes).
CODED_MAX = 0.9
B12X = "b12x"  # a coded matrix with exceptions (kernels/b12.py): the manifest names it so, so that a reader
#                without them refuses the pack instead of multiplying placeholders
CODED_HEAD = "lm_head.weight"
CODED_GQA = ("qwen3_moe", "mixtral", "gpt_oss")
CODED_GQA_SUFFIXES = tuple(f".self_attn.{n}_proj.weight" for n in "qkvo")
CODED_MLP = re.compile(r"model\.layers\.\d+\.(mlp|mlp\.shared_experts|block_sparse_moe\.shared_experts)\."
                       r"(gate|up|down)_proj\.weight")
# Kimi K3's attention (KDA's q/k/v/g/o/b/f_a/f_b and MLA's q_a/q_b/kv_a/g/o projections) and its latent projections
# around the routed experts: every one multiplied by `linear` (MLA's kv_b, folded by row ranges, stays bf16). At full
# width they are 81 of its 114 GB of dense weights.
CODED_K3 = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|g|o|b|f_a|f_b|q_a|q_b)_proj|"
                      r"self_attn\.kv_a_proj_with_mqa|block_sparse_moe\.routed_expert_(down|up)_proj)\.weight")


def _dense_codable(t: TensorInfo, p) -> bool:
    family = p.family
    name = t.name[len(family.prefix):] if t.name.startswith(family.prefix) else None
    if name is None or not b12.supported(tuple(t.shape), DTYPES.get(t.dtype, (None,))[0]):
        return False
    if name == CODED_HEAD:
        return not bool(getattr(p.config, "tie", False))
    if CODED_MLP.fullmatch(name) or (family.model_type == "kimi_k3" and CODED_K3.fullmatch(name)):
        return True
    return family.model_type in CODED_GQA and name.startswith("model.layers.") and name.endswith(CODED_GQA_SUFFIXES)


def _lay_out(pp: PackPlan, expert_file_bytes: int) -> None:
    """Offsets of every expert (4 KiB aligned, in layer/expert order) and of its parts; files split at
    `expert_file_bytes` between experts.

    Parts follow each other with under 64 bytes between them, each at the offset modulo 64 it had in the buffer
    the original checkpoint is read into. BLAS kernels pick their code path by operand alignment (a 1-row
    matrix-vector product sums in a different order for a 16-byte-aligned weight than for an 8-byte-aligned
    one), so this is what keeps a packed model's logits bit-identical to the original's.

    With a codec, experts of one shape differ in size by their rows stored whole and exceptions; each is padded with
    zeros to the longest of its shape (in any layer), so that they all take read buffers of one size and an evicted
    expert's buffer is recycled for the next read, whatever its layer (a buffer of a new size is fresh memory, whose first
    touch costs: with padding per layer a 256-sequence batch step ran 12% slower than without the codec)."""
    longest: dict[tuple, int] = {}
    for ex in pp.experts:
        length = 0
        for part in ex.parts:
            part.offset = length + (part.phase - length) % PART_ALIGN
            length = part.offset + part.nbytes
        ex.length = length
        longest[_shape(ex)] = max(longest.get(_shape(ex), 0), length)
    pos, sizes = HEADER_BYTES, []
    for ex in pp.experts:
        if pp.codec:
            ex.length = longest[_shape(ex)]
        length = ex.length
        if pos > HEADER_BYTES and pos + length > expert_file_bytes:
            sizes.append(pos)
            pos = HEADER_BYTES
        ex.file, ex.offset = len(sizes), pos
        pos = _up(pos + length, ALIGN)
    if pp.experts:
        sizes.append(pos)
    pp.expert_file_sizes = sizes


def _shape(ex: ExpertPlan) -> tuple:
    return tuple((p.src.dtype, tuple(p.src.shape)) for p in ex.parts)


def _codable(part: PartPlan) -> bool:
    return b12.supported(tuple(part.src.shape), DTYPES.get(part.src.dtype, (None,))[0])


def _codable_bytes(pp: PackPlan) -> int:
    return sum(p.src.nbytes for e in pp.experts for p in e.parts if _codable(p)) + \
        sum(t.nbytes for s in pp.dense_shards for t in s if t.name in pp.dense_codable)


def _size_coded(pp: PackPlan, progress: Progress) -> None:
    """The coded size of every expert part and dense matrix the coding takes (its rows stored whole are known
    only from its values, so each is read once here and once when written)."""
    src = _Source()
    try:
        for ex in pp.experts:
            for part in ex.parts:
                if _codable(part):
                    w = _matrix(src, part.src)
                    raw, exc = b12.smaller_form(w)  # as for dense matrices
                    part.coded, part.exceptions = b12.coded_nbytes(*w.shape, raw, exc), exc
                    progress(part.src.nbytes)
        sizes: dict[str, list[int]] = {}  # packed tensor -> [coded bytes, bf16 bytes] over its parts
        for part in (p for ex in pp.experts for p in ex.parts if p.coded >= 0):
            got = sizes.setdefault(part.tensor, [0, 0])
            got[0], got[1] = got[0] + part.coded, got[1] + part.src.nbytes
        for part in (p for ex in pp.experts for p in ex.parts if p.coded >= 0):
            if sizes[part.tensor][0] > CODED_MAX * sizes[part.tensor][1]:  # the rule for dense matrices
                part.coded, part.exceptions = -1, 0
        for shard in pp.dense_shards:
            for t in shard:
                if t.name in pp.dense_codable:
                    counts = [b12.scan_forms(w) for _, w in src.row_slabs(t)]
                    # the smaller form: a small matrix's table can cost more than the rows it saves storing whole
                    raw, exc = min(((sum(c[x][0] for c in counts), sum(c[x][1] for c in counts)) for x in (0, 1)),
                                   key=lambda f: b12.coded_nbytes(*t.shape, *f))
                    if b12.coded_nbytes(*t.shape, raw, exc) <= CODED_MAX * t.nbytes:
                        pp.dense_coded[t.name] = b12.coded_nbytes(*t.shape, raw, exc)
                        if exc:
                            pp.dense_exceptions[t.name] = exc
                    progress(t.nbytes)
    finally:
        src.close()


def _matrix(src: "_Source", t: TensorInfo):
    """One part's bf16 matrix, read whole (one expert matrix: the packer's largest allocation with a codec; dense
    matrices are coded a slab of rows at a time, _write_coded)."""
    return src.rows(t, 0, t.shape[0])


# ---- writing ----------------------------------------------------------------------------------------------
class _Source:
    """Positioned reads from the source shards into one reused buffer; pages are dropped after each chunk."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}
        self.buf = bytearray(CHUNK)

    def _fd(self, t: TensorInfo) -> int:
        fd = self.fds.get(t.file)
        if fd is None:
            try:
                fd = self.fds[t.file] = os.open(t.file, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{t.file}: cannot open the source shard: {e}") from None
        return fd

    def chunks(self, t: TensorInfo):
        """Yield memoryviews over consecutive chunks of the tensor's bytes (valid until the next chunk)."""
        fd = self._fd(t)
        done, view = 0, memoryview(self.buf)
        while done < t.nbytes:
            want = min(CHUNK, t.nbytes - done)
            try:
                got, _ = pread_fill(fd, [view[:want]], t.offset + done)
            except OSError as e:
                raise CheckpointError(f"{t.file}: read error in tensor {t.name!r}: {e}") from None
            if got < want:
                raise CheckpointError(f"{t.file}: truncated: tensor {t.name!r} ends at byte "
                                      f"{t.offset + t.nbytes} but the file ends at {t.offset + done + got}")
            drop_pages(fd, t.offset + done, want)
            yield view[:want]
            done += want

    def rows(self, t: TensorInfo, start: int, count: int):
        """Rows [start, start + count) of a 2-D tensor, read into a fresh tensor of its dtype (pages dropped)."""
        fd = self._fd(t)
        row = t.nbytes // t.shape[0]
        buf = bytearray(count * row)
        try:
            got, _ = pread_fill(fd, [memoryview(buf)], t.offset + start * row)
        except OSError as e:
            raise CheckpointError(f"{t.file}: read error in tensor {t.name!r}: {e}") from None
        if got < len(buf):
            raise CheckpointError(f"{t.file}: truncated: tensor {t.name!r} ends past the end of the file")
        drop_pages(fd, t.offset + start * row, len(buf))
        return bytes_to_tensor(buf, t.dtype, (count, *t.shape[1:]))

    def row_slabs(self, t: TensorInfo):
        """(first row, rows) of a 2-D tensor, CHUNK bytes of rows at a time."""
        step = max(1, CHUNK // max(1, t.nbytes // t.shape[0]))
        for r in range(0, t.shape[0], step):
            yield r, self.rows(t, r, min(step, t.shape[0] - r))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _safetensors_header(entries: dict, metadata: dict, pad_to: int | None = None) -> bytes:
    body = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    total = pad_to - 8 if pad_to is not None else _up(len(body), 8)
    if len(body) > total:
        raise MoestreamError("internal: safetensors header does not fit its reserved space")
    body += b" " * (total - len(body))
    return len(body).to_bytes(8, "little") + body


def _write_dense(path: Path, tensors: list[TensorInfo], src: _Source, progress: Progress,
                 coded: dict[str, int], exceptions: dict[str, int]) -> dict[str, int]:
    """One dense shard; a tensor in `coded` is stored as its b12 bytes (with `exceptions[name]` exceptions: b12x),
    declared U8 [coded size] (the manifest's dense_codec gives its dtype and shape)."""
    entries, at = {}, 0
    for t in tensors:
        n = coded.get(t.name, t.nbytes)
        dtype, shape = ("U8", [n]) if t.name in coded else (t.dtype, list(t.shape))
        entries[t.name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    crcs = {}
    with open(path, "wb") as f:
        f.write(_safetensors_header(entries, {"format": "pt", "packed_by": "moestream"}))
        for t in tensors:
            crc = 0
            if t.name in coded:
                crc = _write_coded(f, src, t, coded[t.name], exceptions.get(t.name, 0))
                progress(t.nbytes)
            else:
                for chunk in src.chunks(t):
                    crc = crc32(chunk, crc)
                    f.write(chunk)
                    progress(len(chunk))
            crcs[t.name] = crc
        f.flush()
        os.fsync(f.fileno())
    return crcs


def _write_coded(f, src: "_Source", t: TensorInfo, size: int, exceptions: int) -> int:
    """A dense matrix's b12 coding (with its `exceptions` sized before: b12x) written a slab of rows at a time
    (kernels/b12.py encode_rows: bounded memory for any size, the exceptions kept until the slots are written);
    returns its crc32. CheckpointError when the bytes differ from the size planned (a changed source)."""
    n, k = t.shape
    bases, raw, crc, written = bytearray(n), [], 0, 0
    table, counts, entries = b12.table_nbytes(n, exceptions), [], []
    for r, w in src.row_slabs(t):
        slots, b, ids, cnt, ent = b12.encode_rows(w, n, len(raw), exceptions > 0, table)
        data = memoryview(slots.numpy()).cast("B")
        crc, written = crc32(data, crc), written + f.write(data)
        bases[r:r + len(b)] = b.numpy().tobytes()
        raw += [r + int(i) for i in ids]
        counts.append(cnt)
        entries.append(ent)
    tail = bytes(bases) + bytes(-(-n // 64) * 64 - n)
    if table:
        got = torch.cat(entries)
        if len(got) != exceptions:
            raise CheckpointError(f"{t.file}: tensor {t.name!r} changed while packing")
        tail += b12.table_bytes(n, torch.cat(counts), got)
    crc, written = crc32(tail, crc), written + f.write(tail)
    for i in raw:  # the rows stored whole, in order, read again from the source
        data = memoryview(src.rows(t, i, 1).view(torch.uint8).numpy()).cast("B")
        crc, written = crc32(data, crc), written + f.write(data)
    if written != size:
        raise CheckpointError(f"{t.file}: tensor {t.name!r} changed while packing")
    return crc


def _write_experts(path: Path, experts: list[ExpertPlan], size: int, src: _Source, progress: Progress) -> None:
    zeros = bytes(ALIGN)
    with open(path, "wb") as f:
        f.write(bytes(HEADER_BYTES))  # the header goes in last, once the blob's size is known
        pos = HEADER_BYTES
        for ex in experts:
            f.write(zeros[:ex.offset - pos])
            crc, at = 0, 0
            for part in ex.parts:
                pad = zeros[:part.offset - at]
                crc = crc32(pad, crc)
                f.write(pad)
                if part.coded >= 0:
                    data = memoryview(b12.encode(_matrix(src, part.src), exceptions=part.exceptions > 0).numpy())
                    if len(data) != part.coded:  # the source changed between sizing and writing
                        raise CheckpointError(f"{part.src.file}: tensor {part.tensor!r} changed while packing")
                    crc = crc32(data, crc)
                    f.write(data)
                    progress(part.src.nbytes)
                else:
                    for chunk in src.chunks(part.src):
                        crc = crc32(chunk, crc)
                        f.write(chunk)
                        progress(len(chunk))
                at = part.offset + part.nbytes
            if ex.length > at:  # a coded expert padded to the longest of its shape (_lay_out)
                tail = bytes(ex.length - at)
                crc = crc32(tail, crc)
                f.write(tail)
            ex.crc32 = crc
            pos = ex.offset + ex.length
        f.write(zeros[:size - pos])
        blob = size - HEADER_BYTES
        f.seek(0)
        f.write(_safetensors_header({EXPERT_BLOB: {"dtype": "U8", "shape": [blob], "data_offsets": [0, blob]}},
                                    {"format": "moestream-packed-experts", "manifest": PACK_MANIFEST}, HEADER_BYTES))
        f.flush()
        os.fsync(f.fileno())


def _copy_other_files(src: Path, tmp: Path, skip: set[str]) -> list[str]:
    """Config, tokenizer, chat template, generation config, README...: every file but weights, copied as bytes."""
    copied = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = Path(root).relative_to(src)
        for name in sorted(files):
            rp = rel / name
            if name.startswith(".") or name.endswith(WEIGHT_SUFFIXES) or name == "model.safetensors.index.json" \
                    or str(rp) in skip:
                continue
            full = Path(root) / name
            if not full.is_file():  # dangling link, socket...
                continue
            (tmp / rel).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(full, tmp / rp)
            copied.append(str(rp))
    return copied


def pack(src: str | Path, dst: str | Path, verify: bool = False, progress: Progress | None = None,
         total: Callable[[int], None] | None = None, dense_shard_bytes: int = DENSE_SHARD_BYTES,
         expert_file_bytes: int = EXPERT_FILE_BYTES, codec: str | None = None) -> PackSummary:
    """Write the packed form of checkpoint `src` to the new directory `dst` (atomically). `total(n)` is told the
    payload bytes first, then `progress(k)` after every copied chunk (with codec "b12", the coded experts' bytes
    count twice: once when sized, once when written). codec "b12": bf16 expert matrices whose rows are a multiple
    of 64 values, and the dense matrices _dense_codable names, are stored in kernels/b12.py's lossless coding
    (the same values, 25% fewer bytes)."""
    src, dst = Path(src), Path(dst)
    if dst.exists() or dst.is_symlink():
        raise MoestreamError(f"{dst}: already exists; `moestream pack` never overwrites, choose a new directory")
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a checkpoint directory")
    if dst.resolve().is_relative_to(src.resolve()):
        raise MoestreamError(f"{dst}: must not lie inside the source checkpoint {src}")
    if codec not in (None, "b12"):
        raise MoestreamError(f"--codec must be b12 (or none), got {codec!r}")
    pp, index = plan_pack(src, dense_shard_bytes, expert_file_bytes)
    parent = dst.parent if str(dst.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    progress = progress or (lambda n: None)
    if total is not None:
        total(pp.payload_bytes + (_codable_bytes(pp) if codec else 0))
    if codec:  # sized before anything is written: the layout and the free-space check need the coded sizes
        pp.codec = codec
        _size_coded(pp, progress)
        _lay_out(pp, expert_file_bytes)
    free = shutil.disk_usage(parent).free
    if pp.disk_bytes > free:
        raise MoestreamError(f"{parent}: {pp.disk_bytes} bytes needed for the packed checkpoint, {free} free")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.packing-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; DST gets the permissions a mkdir would give
    source = _Source()
    try:
        skip = set()
        if index.packed:  # re-packing a packed checkpoint: its manifest is replaced, not copied
            skip.add(PACK_MANIFEST)
        _copy_other_files(src, tmp, skip)
        n_dense, n_exp = len(pp.dense_shards), len(pp.expert_file_sizes)
        crcs: dict[str, int] = {}
        for i, shard in enumerate(pp.dense_shards):
            crcs.update(_write_dense(tmp / dense_name(i, n_dense), shard, source, progress, pp.dense_coded,
                                     pp.dense_exceptions))
        for i, size in enumerate(pp.expert_file_sizes):
            _write_experts(tmp / expert_name(i, n_exp), [e for e in pp.experts if e.file == i], size, source, progress)
        manifest = _manifest(pp, crcs)
        (tmp / PACK_MANIFEST).write_text(json.dumps(manifest, separators=(",", ":")))
        if dst.exists():
            raise MoestreamError(f"{dst}: appeared while packing; not overwritten (the packed copy was discarded)")
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        source.close()
    summary = PackSummary(str(dst), len(pp.experts), len(pp.expert_file_sizes), len(pp.dense_shards),
                          pp.dense_bytes, pp.expert_bytes, sum(f.stat().st_size for f in dst.rglob("*") if f.is_file()),
                          coded_bytes=sum(p.nbytes for e in pp.experts for p in e.parts) if pp.coded_tensors else 0,
                          dense_coded_bytes=sum(pp.dense_coded.values()),
                          dense_coded_source=sum(t.nbytes for s in pp.dense_shards for t in s
                                                 if t.name in pp.dense_coded))
    if verify:
        verify_pack(dst)
        summary.verified = True
    return summary


def _manifest(pp: PackPlan, crcs: dict[str, int]) -> dict:
    n_dense, n_exp = len(pp.dense_shards), len(pp.expert_file_sizes)
    coded = pp.coded_tensors
    with_exceptions = {p.tensor for e in pp.experts for p in e.parts if p.exceptions}
    return {
        "format": PACK_FORMAT, "version": PACK_VERSION, "align": ALIGN, "checksum": "crc32",
        "dense_files": [dense_name(i, n_dense) for i in range(n_dense)],
        "expert_files": [expert_name(i, n_exp) for i in range(n_exp)],
        "dense_crc32": crcs,
        **({"dense_codec": {t.name: {"codec": B12X if t.name in pp.dense_exceptions else pp.codec,
                                     "dtype": t.dtype, "shape": list(t.shape)}
                            for s in pp.dense_shards for t in s if t.name in pp.dense_coded}}
           if pp.dense_coded else {}),
        "tensors": {name: {"dtype": d, "shape": list(s), "fused": f,
                           **({"codec": B12X if name in with_exceptions else pp.codec} if name in coded else {})}
                    for name, (d, s, f) in pp.tensors.items()},
        "experts": [{"layer": e.layer, "expert": e.expert, "file": expert_name(e.file, n_exp), "offset": e.offset,
                     "length": e.length, "crc32": e.crc32,
                     "parts": [{"tensor": p.tensor, "index": p.index, "dtype": p.src.dtype, "shape": list(p.src.shape),
                                "offset": p.offset, "nbytes": p.nbytes,
                                **({"codec": B12X if p.exceptions else pp.codec} if p.coded >= 0 else {})}
                               for p in e.parts]}
                    for e in pp.experts],
    }


# ---- verification ------------------------------------------------------------------------------------------
def verify_pack(path: str | Path, progress: Progress | None = None,
                total: Callable[[int], None] | None = None) -> int:
    """Re-read every expert and dense tensor of a packed directory from disk and check its crc32. Returns the
    number of ranges checked; raises CheckpointError listing the damaged ones."""
    path = Path(path)
    if not (path / PACK_MANIFEST).exists():
        raise CheckpointError(f"{path}: not a packed checkpoint (no {PACK_MANIFEST}); nothing to verify")
    index = CheckpointIndex.open(path)
    ranges = [(f"layer {pe.layer} expert {pe.expert}", TensorInfo("", pe.file, pe.offset, pe.nbytes, "U8",
                                                                    (pe.nbytes,)), pe.crc32) for pe in index.packed]
    ranges += [(f"dense tensor {n!r}", index[n], c) for n, c in index.crcs.items() if n in index]
    missing = [n for n in index.tensors if n not in index.pieces and n not in index.crcs]
    if total is not None:
        total(sum(t.nbytes for _, t, _ in ranges))
    progress = progress or (lambda n: None)
    src, bad = _Source(), []
    try:
        for f in {t.file for _, t, _ in ranges}:  # read the disk, not pages left by the writer
            drop_file_pages(f)
        for what, t, want in ranges:
            crc = 0
            for chunk in src.chunks(t):
                crc = crc32(chunk, crc)
                progress(len(chunk))
            if crc != want:
                bad.append(f"{what} ({t.file.name}, crc32 {crc:08x} != {want:08x})")
    finally:
        src.close()
    if missing:
        bad.append(f"{len(missing)} tensors have no checksum in the manifest (first: {missing[0]!r})")
    if bad:
        shown = "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise CheckpointError(f"{path}: {len(bad)} of {len(ranges)} checksummed ranges are damaged: {shown}")
    return len(ranges)
