"""Writes a random-weight checkpoint directory: sharded safetensors, index, config, generation config, tokenizer.

Owns the random inits (seeded per tensor name and row block, so a tensor does not depend on sharding), the
`ShardWriter` for tensors already in memory (train-demo's export) and the per-vocab-size tokenizer cache.
Synthetic checkpoints stream through synth/stream.py: peak memory is one bounded chunk of one tensor, whatever
the checkpoint's size. Everything is written into a sibling temporary directory and renamed at the end, so
a directory that exists is complete.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from dataclasses import replace
from typing import Iterator

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from moestream.bpe import default_training_text, train_bpe_tokenizer
from moestream.config import format_bytes
from moestream.errors import MoestreamError
from moestream.synth.families import TRANSFORMERS_VERSION, Preset, SpecialIds, SynthFamily, TensorSpec
from moestream.synth.stream import chunk_rows, chunk_seed, nbytes, plan_shards, write_shards

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_CACHE_VERSION = 1  # bump when the training recipe changes
DTYPE = torch.bfloat16
# BPE training stops finding merges in its text well before a real 130-160k vocabulary; a config may name more ids
# than the tokenizer has (the rows past it are never produced by encoding)
MAX_TOKENIZER_VOCAB = 32768


def init_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """A fresh random tensor for `spec` (fp32 maths, cast to the stored dtype)."""
    return _values(spec, torch.Generator().manual_seed(chunk_seed(spec, seed, 0)))


def init_chunks(spec: TensorSpec, seed: int) -> Iterator[torch.Tensor]:
    """`spec`'s values in row blocks of bounded size (one block, the same as init_tensor's, for a small tensor)."""
    rows = chunk_rows(spec)
    total = spec.shape[0] if spec.shape else 1
    if rows >= total:
        yield init_tensor(spec, seed)
        return
    for i, start in enumerate(range(0, total, rows)):
        part = replace(spec, shape=(min(rows, total - start), *spec.shape[1:]))
        yield _values(part, torch.Generator().manual_seed(chunk_seed(spec, seed, i)))


def _values(spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    shape = spec.shape
    if callable(spec.init):
        t = spec.init(shape, gen)
    elif spec.init == "ones":
        t = torch.ones(shape)
    elif spec.init == "zeros":
        t = torch.zeros(shape)
    elif spec.init == "proj":  # keeps activations at unit scale through each projection
        t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    elif spec.init == "embed":  # unit-RMS rows, the scale pre-norm layers expect
        t = torch.randn(shape, generator=gen)
    elif spec.init == "router":
        t = _router(shape, gen)
    else:
        raise ValueError(f"unknown init {spec.init!r} for {spec.name}")
    return t.to(spec.dtype or DTYPE).contiguous()


def _router(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Logits with std about 2 on unit-RMS input, and per-expert row scales in [0.5, 1.5]: routing is decisive
    and experts differ in how often they win, as in trained models (uniform rows would route like a coin)."""
    rows = torch.randn(shape, generator=gen) * (2.0 / math.sqrt(shape[-1]))
    scale = 0.5 + torch.rand((shape[0], 1), generator=gen)  # [E, 1]
    return rows * scale


class ShardWriter:
    """Collects tensors until a shard is full, saves it with safetensors and forgets it."""

    def __init__(self, out_dir: Path, shard_bytes: int, progress: tqdm | None = None):
        self.out_dir = out_dir
        self.shard_bytes = shard_bytes
        self.progress = progress
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # tensor names per written shard
        self.total_bytes = 0
        self.total_params = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += nbytes
        self.total_bytes += nbytes
        self.total_params += tensor.numel()
        if self.progress is not None:
            self.progress.update(nbytes)

    def _flush(self) -> None:
        save_file(self.pending, self.out_dir / f"shard-{len(self.shards)}.tmp", metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> int:
        """Name the shards model-0000i-of-0000n.safetensors and write the index; returns the shard count."""
        if self.pending:
            self._flush()
        n, weight_map = len(self.shards), {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / f"shard-{i}.tmp", self.out_dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_parameters": self.total_params, "total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.out_dir / "model.safetensors.index.json", index)
        return n


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---- tokenizer --------------------------------------------------------------------------------------------------
def cached_tokenizer(vocab_size: int, cache_dir: Path) -> Path:
    """A byte-level BPE with `vocab_size` tokens trained on Python's stdlib sources, trained once per size."""
    target = cache_dir / "tokenizers" / f"bpe-{vocab_size}-v{TOKENIZER_CACHE_VERSION}"
    if all((target / f).is_file() for f in TOKENIZER_FILES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        text = default_training_text(min(4_000_000, max(300_000, vocab_size * 300)))
        train_bpe_tokenizer(text.splitlines(keepends=True), vocab_size, tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first; theirs is as good as ours
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def special_ids(tokenizer_dir: Path) -> SpecialIds:
    """bos = <|endoftext|>, eos = <|im_end|> (the chat turn end, as in Qwen's configs)."""
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    return SpecialIds(bos=ids["<|endoftext|>"], eos=ids["<|im_end|>"], pad=None)


# ---- the whole checkpoint ---------------------------------------------------------------------------------------
def write_checkpoint(family: SynthFamily, p: Preset, out_dir: Path, seed: int, cache_dir: Path,
                     progress: bool = True) -> dict:
    """Write the checkpoint into `out_dir` (which must not exist or be empty). Returns a summary dict."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise MoestreamError(f"{out_dir} already exists and is not empty; remove it or choose another directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".partial.", dir=out_dir.parent))
    try:
        summary = _write_into(family, p, tmp, seed, cache_dir, progress)
        _umask_permissions(tmp)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summary


def _umask_permissions(root: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; give the result the user's usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for f in root.iterdir():
        f.chmod(0o666 & ~umask)


def _write_into(family: SynthFamily, p: Preset, out: Path, seed: int, cache_dir: Path, progress: bool) -> dict:
    tok_dir = cached_tokenizer(min(p.vocab, MAX_TOKENIZER_VOCAB), cache_dir)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tok_dir / name, out / name)
    ids = special_ids(tok_dir)
    config = family.config(p, ids)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", _generation_config(ids))
    specs = list(family.tensors(config))
    total = sum(nbytes(s) for s in specs)
    _check_room(out, total)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, delay=1.0,
               desc=f"writing {p.name} {family.model_type}", disable=not progress)
    shards = plan_shards(specs, p.shard_bytes)
    with bar:
        weight_map = write_shards(out, shards, init_chunks, seed, bar)
    params = sum(s.numel for s in specs)
    index = {"metadata": {"total_parameters": params, "total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)
    return {"model_type": family.model_type, "preset": p.name, "shards": len(shards), "bytes": total,
            "params": params, "seed": seed}


def _check_room(out: Path, total: int) -> None:
    """Refuse before writing a byte when the disk cannot hold the checkpoint (full-width ones are tens of GB)."""
    free = shutil.disk_usage(out).free
    if total > free:
        raise MoestreamError(f"the checkpoint needs {format_bytes(total)} but {out.parent} has "
                             f"{format_bytes(free)} free; use fewer --layers or a smaller --vocab")


def _generation_config(ids: SpecialIds) -> dict:
    return {"_from_model_config": True, "bos_token_id": ids.bos, "eos_token_id": ids.eos,
            "transformers_version": TRANSFORMERS_VERSION, "use_cache": True}
