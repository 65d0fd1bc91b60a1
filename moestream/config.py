"""Typed configuration read in one place: byte sizes ("4GiB"), the engine options, and a checkpoint's config.json.

Owns parsing of user-facing sizes and reading the top-level `config.json` as a dict. Multimodal checkpoints keep
their text model under `text_config`; the families that have one (kimi_k3, kimi_k25) unwrap it themselves. Field
types and ranges are checked by models/hfconfig.py; family-specific fields are read by each family's config.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from moestream.errors import CheckpointError, MoestreamError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int | float | None) -> int | None:
    """'4GiB' -> 4294967296; ints pass through; None stays None (no limit)."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise MoestreamError(f"cannot parse byte size {value!r}: use e.g. 4GiB, 512MiB, 2GB or a plain integer")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


KV_DTYPE_NAMES = ("fp32", "bf16", "int8", "int4")  # --kv-dtype choices (memory/state.py maps them to torch dtypes)
COMPUTE_DTYPE_NAMES = ("fp32", "bf16")  # --compute-dtype choices (models/blocks.py's many-row products)
# no --ram-budget: the share of the memory available that run / serve / batch / bench / trace take as the budget
# for a model that does not fit in it (cli/common.resolve_budget), and that plan plans for (planner/plan.py)
DEFAULT_BUDGET_SHARE = 0.75


@dataclass
class EngineOptions:
    ram_budget: int | None = None  # bytes; None = no limit
    device: str = "cpu"
    cache_policy: str = "lfru"  # chosen by measurement: docs/performance.md
    io_threads: int = 2  # reads in flight (experts.reader.IO_THREADS)
    prefill_chunk: int = 512
    threads: int | None = None  # torch compute threads; None keeps torch's default (one per physical core)
    kv_dtype: str = "fp32"  # KV / latent cache storage: "fp32" (the parity bounds are fp32's), "bf16" (half),
    # "int8" (grouped int8 + fp32 scales, about half of bf16's bytes) or "int4" (grouped int4, two a byte, + fp32
    # scales, about half of int8's; kernels/kvquant.py)
    # many-row products (prefill chunks, batch steps): "fp32" (default, the parity bounds) or "bf16" (bf16 weights
    # times bf16-rounded activations, fp32 sums: faster, about bf16's rounding off the fp32 logits; models/blocks.py)
    compute_dtype: str = "fp32"
    # a row's logits bit-identical whatever rows share its step (kernels/invariant.py; fp32 compute only)
    batch_invariant: bool = False
    # a streamed lm_head keeps its leading rows resident out of the expert cache's room beyond 2 x top_k experts
    # (engine/residency.py); the batch job and the server turn it off unless --state-room reserves their state
    head_rows: bool = True


def read_model_config(root: str | Path) -> dict:
    """The checkpoint's whole config.json as a dict (a multimodal one's `text_config` is left for its family)."""
    path = Path(root) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{root}: no config.json (is this a Hugging Face checkpoint directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: malformed config.json: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise CheckpointError(f"{path}: config.json has no model_type")
    return cfg


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/moestream, else ~/.cache/moestream (trained tokenizers, the demo checkpoint)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moestream"
