"""Batch invariance (EngineOptions.batch_invariant; `moestream batch` turns it on with fp32 compute): a row's
logits bit-identical whatever other rows share its step.

Owns the switch the compute paths read (`active()`, set for a step by `mode`) and the rank-order combine of a MoE
layer's per-slot expert outputs. Under it: dense products, routers and the lm_head go through one fixed-order
native kernel (`cpu.linear_fixed`, each output one fp32 sum over its inputs in order for any row count; the
routers' softmax and top-k one row at a time), the grouped GLU experts run every expert on the panel kernel and
store each (row, slot) output apart (fused.moe_glu_bf16 with `pairs`), summed here in slot order, so the order the
experts ran in (cache hits first, reads as they land) no longer matters; one-token steps skip the fused decode
layer, decode rows always take the paged attention call and prompt chunks the tiled / flash path (models/), and
the scheduler cuts a prompt into chunks by its own length alone (server/scheduler.py). What it does not cover is
listed in README.md's batch section (quantised weights and experts, bf16 compute, sigmoid / biased routers, MLA /
KDA attention, prefix reuse).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

from moestream.kernels import cpu

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("moestream_batch_invariant", default=False)


def active() -> bool:
    """Whether the running step computes batch-invariantly."""
    return _ON.get()


@contextlib.contextmanager
def mode(on: bool) -> Iterator[None]:
    """Within the block (this thread / context), compute batch-invariantly when `on`."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def combine(pairs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * pairs[t, j] over the slots in order (slot 0 first), fp32 [T, D]: each product and each
    sum one elementwise op, so a row's result depends on its own slots alone. pairs [T, k, D], weights [T, k].
    Natively in one pass where the kernels are built (the same operations in the same order)."""
    if cpu.available():
        return cpu.combine_slots(pairs, weights)
    w = weights.float()
    out = pairs[:, 0] * w[:, 0:1]
    for j in range(1, pairs.shape[1]):
        out = out + pairs[:, j] * w[:, j:j + 1]
    return out
