"""Synthetic checkpoints: random weights in a family's real Hugging Face layout, for tests, demos and benchmarks.

`synthesize(family, out_dir, preset)` writes config.json, generation_config.json, a trained BPE tokenizer with a
chat template, and sharded bf16 safetensors with an index. Layouts live in families.py, bytes in writer.py.
The text such a model writes is noise; its sizes, routing and I/O behave like a real checkpoint's.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from moestream.config import default_cache_dir, format_bytes
from moestream.errors import MoestreamError
from moestream.synth.families import (FULL_WIDTH, PRESETS, SYNTHS, Preset, SpecialIds, SynthFamily, preset, register,
                                      supported, synth_family)
from moestream.synth.stream import nbytes
from moestream.synth.writer import write_checkpoint

__all__ = ["FULL_WIDTH", "PRESETS", "SYNTHS", "Preset", "SynthFamily", "default_cache_dir", "full_width_families",
           "full_width_sizes", "preset", "register", "supported", "synth_family", "synthesize"]



def synthesize(family: str, out_dir: str | Path, preset_name: str = "tiny", seed: int = 0,
               cache_dir: str | Path | None = None, progress: bool = True, layers: int | None = None,
               vocab: int | None = None) -> dict:
    """Write a random-weight checkpoint of `family` into `out_dir`; returns a summary (shards, bytes, params).
    `layers` / `vocab` override the preset's layer count and vocabulary size (other widths stay the preset's).
    The `full-width` preset needs `layers`; its vocabulary defaults to the published one."""
    fam = synth_family(family)
    shape = _shape(fam, preset(preset_name), layers, vocab)
    summary = write_checkpoint(fam, shape, Path(out_dir), seed,
                               Path(cache_dir) if cache_dir is not None else default_cache_dir(), progress)
    return {**summary, "path": str(out_dir)}


def _shape(fam: SynthFamily, shape: Preset, layers: int | None, vocab: int | None) -> Preset:
    for name, value in (("layers", layers), ("vocab", vocab)):
        if value is not None:
            if value < 1:
                raise MoestreamError(f"--{name} must be at least 1, got {value}")
            shape = replace(shape, **{name: value})
    if shape.name != FULL_WIDTH:
        return shape
    if fam.full_vocab is None:
        raise MoestreamError(f"--preset {FULL_WIDTH} is not available for {fam.model_type}; it is for "
                             f"{', '.join(full_width_families())}")
    if layers is None:
        moe = full_width_sizes(fam.model_type, 2, vocab)["layers"][-1]
        raise MoestreamError(f"--preset {FULL_WIDTH} needs --layers N (a {fam.model_type} MoE layer alone is "
                             f"{format_bytes(moe)}; --layers 2 writes one dense and one MoE layer)")
    return shape if vocab is not None else replace(shape, vocab=fam.full_vocab)


def full_width_families() -> list[str]:
    return [name for name in supported() if synth_family(name).full_vocab is not None]


def full_width_sizes(family: str, layers: int = 2, vocab: int | None = None) -> dict:
    """Bytes on disk of a full-width checkpoint of `layers` layers, from the tensor inventory alone: per layer
    (`layers`, `moe` marks which are MoE), embeddings + lm_head + the rest (`other`), and the `total`."""
    fam = synth_family(family)
    shape = replace(preset(FULL_WIDTH), layers=layers, vocab=vocab or fam.full_vocab or 0)
    config = fam.config(shape, SpecialIds(bos=0, eos=1))
    per_layer, other = [0] * layers, 0
    for spec in fam.tensors(config):
        layer = _layer_of(spec.name)
        if layer is None:
            other += nbytes(spec)
        else:
            per_layer[layer] += nbytes(spec)
    moe = set(_moe_layers(config))
    return {"layers": per_layer, "moe": [i in moe for i in range(layers)], "other": other,
            "total": sum(per_layer) + other}


def _moe_layers(config: dict) -> list[int]:
    text = config.get("text_config", config)
    first = text.get("first_k_dense_replace", 0)
    return list(range(first, text["num_hidden_layers"]))


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    return None
