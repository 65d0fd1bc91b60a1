"""Synthetic checkpoints: random weights in a family's real Hugging Face layout, for tests, demos and benchmarks.

`synthesize(family, out_dir, preset)` writes config.json, generation_config.json, a trained BPE tokenizer with a
chat template, and sharded bf16 safetensors with an index. Layouts live in families.py, bytes in writer.py.
The text such a model writes is noise; its sizes, routing and I/O behave like a real checkpoint's.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from moestream.config import default_cache_dir
from moestream.errors import MoestreamError

from moestream.synth.families import PRESETS, SYNTHS, Preset, SynthFamily, preset, register, supported, synth_family
from moestream.synth.writer import write_checkpoint

__all__ = ["PRESETS", "SYNTHS", "Preset", "SynthFamily", "default_cache_dir", "preset", "register", "supported",
           "synth_family", "synthesize"]



def synthesize(family: str, out_dir: str | Path, preset_name: str = "tiny", seed: int = 0,
               cache_dir: str | Path | None = None, progress: bool = True, layers: int | None = None,
               vocab: int | None = None) -> dict:
    """Write a random-weight checkpoint of `family` into `out_dir`; returns a summary (shards, bytes, params).
    `layers` / `vocab` override the preset's layer count and vocabulary size (other widths stay the preset's)."""
    fam = synth_family(family)
    shape = preset(preset_name)
    for name, value in (("layers", layers), ("vocab", vocab)):
        if value is not None:
            if value < 1:
                raise MoestreamError(f"--{name} must be at least 1, got {value}")
            shape = replace(shape, **{name: value})
    summary = write_checkpoint(fam, shape, Path(out_dir), seed,
                               Path(cache_dir) if cache_dir is not None else default_cache_dir(), progress)
    return {**summary, "path": str(out_dir)}
