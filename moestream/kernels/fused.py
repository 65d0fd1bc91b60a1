"""Fused native kernels for a decode step: the grouped GLU experts of a layer step, the softmax top-k router,
rms_norm and GQA attention.

Thin, checked wrappers over `_cpu.c` (loaded by kernels/cpu.py): shapes and dtypes are validated here, pointers
passed there. Callers (models/blocks.py, models/attention.py) decide when to use them and keep torch paths.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from moestream.kernels.cpu import _addresses, required


ACTIVATIONS = {"silu": 0, "situ": 1}  # the GLU activations ms_moe_glu_bf16 computes


def moe_glu_bf16(x: Tensor, experts: Sequence[int], parts: Sequence[tuple[int, int, int]], inter: int, out: Tensor,
                 ids: Tensor | None = None, scores: Tensor | None = None, act: str = "silu", beta: float = 0.0,
                 linear_beta: float = 0.0) -> None:
    """Several bf16 GLU experts in one native call, added into out [T, D] (fp32, contiguous):
    out[t] += scores[t, j] * down_e act(gate_e x[t], up_e x[t]) for every (t, j) with ids[t, j] == experts[e].
    parts[e] = addresses of expert e's contiguous bf16 gate [inter, K], up [inter, K] and down [D, inter]; the
    caller checked those shapes and keeps the tensors alive. Without ids, every token goes through every expert
    with weight 1. x [T, K]; ids int64 and scores fp32 [T, k]."""
    handle = required()
    t, k_in = x.shape
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    if out.dtype != torch.float32 or not out.is_contiguous() or out.dim() != 2 or out.shape[0] != t:
        raise ValueError(f"moe_glu_bf16 wants a contiguous fp32 out [{t}, D], got {tuple(out.shape)} {out.dtype}")
    top = 0
    if ids is not None:
        if scores is None or ids.shape != scores.shape or ids.dim() != 2 or ids.shape[0] != t:
            raise ValueError("moe_glu_bf16 wants ids and scores of one shape [T, k]")
        ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.long().contiguous()
        scores = scores if scores.dtype == torch.float32 and scores.is_contiguous() else scores.float().contiguous()
        top = ids.shape[1]
    code = handle.ms_moe_glu_bf16(len(parts), _addresses(experts), _addresses([p[0] for p in parts]),
                                  _addresses([p[1] for p in parts]), _addresses([p[2] for p in parts]), inter, k_in,
                                  out.shape[1], x.data_ptr(), t, None if ids is None else ids.data_ptr(),
                                  None if scores is None else scores.data_ptr(), top, out.data_ptr(),
                                  ACTIVATIONS[act], beta, linear_beta)
    if code != 0:
        raise MemoryError("native GLU expert kernel could not allocate its scratch")


def router_softmax_topk(x: Tensor, gate: Tensor, k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The Mixtral / Qwen3-MoE router in one native call: softmax(x @ gate^T) over all experts in fp32, the top k
    (best first) and their probabilities (divided by their sum when renormalize). x fp32 [T, K] contiguous, gate
    contiguous bf16 [E, K]. Returns (ids int64 [T, k], weights fp32 [T, k]), what blocks.softmax_topk returns."""
    handle = required()
    t, k_in = x.shape
    e = gate.shape[0]
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("router_softmax_topk wants a contiguous fp32 x [T, K]")
    if gate.dtype != torch.bfloat16 or not gate.is_contiguous() or gate.dim() != 2 or gate.shape[1] != k_in:
        raise ValueError(f"router_softmax_topk wants a contiguous bf16 gate [E, {k_in}], got {tuple(gate.shape)}")
    if not 0 < k <= e:
        raise ValueError(f"router_softmax_topk: top-{k} of {e} experts")
    ids = torch.empty(t, k, dtype=torch.int64)
    wts = torch.empty(t, k, dtype=torch.float32)
    if handle.ms_router_softmax_topk(x.data_ptr(), t, k_in, gate.data_ptr(), e, k, int(renormalize), ids.data_ptr(),
                                     wts.data_ptr()):
        raise MemoryError("native router could not allocate its scratch")
    return ids, wts


def norm_weight(w: Tensor | None) -> tuple[int | None, int]:
    """(address, 1 if bf16 else 0) of a contiguous fp32 or bf16 norm weight for the native norms; (None, 0) for
    none. ValueError for anything else."""
    if w is None:
        return None, 0
    if w.dtype not in (torch.float32, torch.bfloat16) or not w.is_contiguous():
        raise ValueError(f"native norms want a contiguous fp32 or bf16 weight, got {w.dtype}")
    return w.data_ptr(), int(w.dtype == torch.bfloat16)


def rms_norm(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    """rms_norm over the last dim of a contiguous fp32 x [..., H], times w (fp32 or bf16 [H]) when given."""
    handle = required()
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("native rms_norm wants a contiguous fp32 x")
    out = torch.empty_like(x)
    h = x.shape[-1]
    ptr, bf16 = norm_weight(w)
    handle.ms_rms_norm(x.data_ptr(), x.numel() // max(1, h), h, ptr, bf16, eps, out.data_ptr())
    return out


def gqa_attend(q: Tensor, keys: Tensor, values: Tensor, new: int, scale: float, q_norm: Tensor | None = None,
               k_norm: Tensor | None = None, eps: float = 1e-6, inv_freq: Tensor | None = None,
               factor: float = 1.0, window: int | None = None) -> Tensor:
    """Causal GQA attention of one sequence's `new` tokens over its cache, in one native call: q fp32 [T, Hq, D]
    (T = new) and the last `new` rows of keys [L, Hkv, D] are per-head rms-normalised (q_norm / k_norm) and
    rotate-half roped (inv_freq [D/2], positions L - new ..) in place first. keys, values contiguous fp32 (the
    KV cache rows). With a window, each query sees only the last `window` positions up to its own. Returns
    [T, Hq, Dv]."""
    handle = required()
    t, hq, d = q.shape
    length, hkv, dv = values.shape
    for name, m in (("q", q), ("keys", keys), ("values", values)):
        if m.dtype != torch.float32 or not m.is_contiguous():
            raise ValueError(f"gqa_attend wants contiguous fp32 {name}")
    if keys.shape != (length, hkv, d) or hq % hkv or new != t or new > length:
        raise ValueError(f"gqa_attend: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    if inv_freq is not None and (inv_freq.dtype != torch.float32 or inv_freq.numel() * 2 != d):
        raise ValueError("gqa_attend wants fp32 inv_freq [D/2]")
    qn, qbf16 = norm_weight(q_norm)
    kn, kbf16 = norm_weight(k_norm)
    if q_norm is not None and k_norm is not None and qbf16 != kbf16:
        raise ValueError("gqa_attend wants q_norm and k_norm of one dtype")
    out = torch.empty(t, hq, dv, dtype=torch.float32)
    if handle.ms_gqa_attend(t, hq, hkv, d, dv, q.data_ptr(), keys.data_ptr(), values.data_ptr(), length, qn, kn,
                            qbf16 or kbf16, eps, None if inv_freq is None else inv_freq.data_ptr(), factor, scale,
                            window or 0, out.data_ptr()):
        raise MemoryError("native attention could not allocate its scores")
    return out

