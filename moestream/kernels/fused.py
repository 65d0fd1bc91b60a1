"""Fused native kernels for a decode step: the grouped GLU experts of a layer step, the softmax top-k router,
rms_norm and GQA attention.

Thin, checked wrappers over `_cpu.c` (loaded by kernels/cpu.py): shapes and dtypes are validated here, pointers
passed there. Callers (models/blocks.py, models/attention.py) decide when to use them and keep torch paths.
"""
from __future__ import annotations

import ctypes
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from moestream.kernels import cpu
from moestream.kernels.cpu import MIN_ROWS_PER_THREAD, _addresses, lib, required


ACTIVATIONS = {"silu": 0, "situ": 1}  # the GLU activations ms_moe_glu_bf16 computes


def moe_glu_bf16(x: Tensor, experts: Sequence[int], parts: Sequence[tuple[int, int, int]], inter: int, out: Tensor,
                 ids: Tensor | None = None, scores: Tensor | None = None, act: str = "silu", beta: float = 0.0,
                 linear_beta: float = 0.0, counts: Sequence[int] | None = None, compute: str = "fp32",
                 workspace: Tensor | None = None) -> None:
    """Several bf16 GLU experts, added into out [T, D] (fp32, contiguous):
    out[t] += scores[t, j] * down_e act(gate_e x[t], up_e x[t]) for every (t, j) with ids[t, j] == experts[e].
    parts[e] = addresses of expert e's contiguous bf16 gate [inter, K], up [inter, K] and down [D, inter]; the
    caller checked those shapes and keeps the tensors alive. Without ids, every token goes through every expert
    with weight 1. x [T, K]; ids int64 and scores fp32 [T, k].

    One native call when its scratch (which grows with the routed rows: a prefill chunk of thousands of tokens
    routes hundreds to each expert) fits in one expert's fp32 size, the compute scratch the budget holds for an
    expert; otherwise consecutive groups of experts in calls that each fit, and an expert too large alone in
    token ranges. Each expert still sees all its rows in one call where it fits alone, and experts are added
    into out in the same order, so the results do not depend on the split. `counts[e]`: the (token, slot) pairs
    routed to experts[e], where the caller already knows them (the runner's Routing does), so the ids need not
    be counted here (a bincount over every pair of the step, once per call: a 1,220-row step that computes its
    experts one call each went from 5.1-5.5 to 4.2-4.4 s without it, docs/performance.md).

    compute "bf16" (the opt-in bf16 compute path, EngineOptions.compute_dtype; K and inter even): x and the GLU
    activations are rounded to bf16 and the products summed in fp32 (_cpu_bf16.c). An expert routed fewer than
    cpu.lib().ms_bf16dot_row_limit() (16) rows of the call runs on the row kernel, the others on panels; a token's
    sums do not depend on the other tokens beyond that choice, and the split into calls keeps it (token ranges
    never leave an expert fewer rows than the limit); "fp32" (default): fp32 activations.

    `workspace` (bf16 compute): a uint8 buffer of at least glu_scratch_cap bytes that every call takes its
    scratch from instead of allocating its own (`glu_workspace`: one an engine keeps, so that its pages are
    faulted in once, not once a call); the same sums either way.

    The batch-invariant form (kernels/invariant.py): `out` fp32 [T, k, D] (ids required, compute "fp32") receives
    each (t, j) pair's unweighted expert output at out[t, j] (ms_moe_glu_bf16_pairs: every expert on the panel
    kernel), for the caller to sum in slot order."""
    required()
    t, k_in = x.shape
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    pairs = out.dim() == 3
    if pairs and (ids is None or compute != "fp32" or out.shape[1] != ids.shape[1]):
        raise ValueError("moe_glu_bf16: per-pair outputs [T, k, D] need ids [T, k] and fp32 compute")
    if out.dtype != torch.float32 or not out.is_contiguous() or out.dim() not in (2, 3) or out.shape[0] != t:
        raise ValueError(f"moe_glu_bf16 wants a contiguous fp32 out [{t}, D], got {tuple(out.shape)} {out.dtype}")
    if ids is not None:
        if scores is None or ids.shape != scores.shape or ids.dim() != 2 or ids.shape[0] != t:
            raise ValueError("moe_glu_bf16 wants ids and scores of one shape [T, k]")
        ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.long().contiguous()
        scores = scores if scores.dtype == torch.float32 and scores.is_contiguous() else scores.float().contiguous()
    if counts is not None and len(counts) != len(experts):
        raise ValueError(f"moe_glu_bf16: {len(counts)} counts for {len(experts)} experts")
    if compute not in ("fp32", "bf16"):
        raise ValueError(f"moe_glu_bf16: compute must be fp32 or bf16, got {compute!r}")
    bf16 = compute == "bf16"
    if bf16 and (inter % 2 or k_in % 2):
        raise ValueError(f"moe_glu_bf16: bf16 compute wants even widths, got inter {inter}, K {k_in}")
    call = _GluCall(experts, parts, inter, k_in, out.shape[-1], act, beta, linear_beta, bf16, pairs)
    cap = glu_scratch_cap(inter, k_in, out.shape[-1])  # (coded experts' decode rows: b12_scratch, counted apart)
    if bf16 and workspace is not None and workspace.numel() >= cap:
        call.workspace = workspace
    # what any routing of these rows could need (t x k pairs, at most t per expert): a decode step fits without
    # counting its pairs
    n_pairs = t * (len(experts) if ids is None else ids.shape[1])
    if _call_scratch(n_pairs, len(experts), t, inter, k_in, bf16, pairs) <= cap:
        call(range(len(experts)), x, ids, scores, out)
        return
    counts = _pair_counts(experts, ids, t) if counts is None else list(counts)
    if glu_call_scratch(counts, inter, k_in, bf16, pairs) <= cap:
        call(range(len(experts)), x, ids, scores, out)
        return
    groups = _expert_groups(counts, inter, k_in, cap, bf16, pairs)
    if bf16 and call.workspace is None:
        # one scratch for all the calls (the largest call's, within the cap), so its pages are faulted in once
        call.workspace = torch.empty(max(min(cap, glu_call_scratch([counts[i] for i in g], inter, k_in, True))
                                         for g in groups), dtype=torch.uint8)
    for group in groups:
        if len(group) > 1 or glu_call_scratch([counts[group[0]]], inter, k_in, bf16, pairs) <= cap:
            call(group, x, ids, scores, out)
            continue
        for lo, hi in _token_ranges(experts[group[0]], ids, t, counts[group[0]], inter, k_in, cap, bf16, pairs):
            call(group, x[lo:hi], None if ids is None else ids[lo:hi], None if scores is None else scores[lo:hi],
                 out[lo:hi])


def glu_workspace(holder: dict, inter: int, k_in: int, d_out: int) -> Tensor:
    """`holder`'s GLU workspace (key "glu"), at least glu_scratch_cap bytes for these widths: made on first use
    and kept, so that the bf16 GLU calls of every later step reuse its pages. It lies within the fixed compute
    scratch the budget holds for an expert (engine._scratch_bytes: one expert's fp32 size, glu_scratch_cap)."""
    need = glu_scratch_cap(inter, k_in, d_out)
    ws = holder.get("glu")
    if ws is None or ws.numel() < need:
        holder["glu"] = ws = torch.empty(need, dtype=torch.uint8)
    return ws


def b12_scratch(widest: int) -> int:
    """An upper bound of what a call over b12-coded experts whose matrices are at most `widest` values wide
    mallocs beyond glu_call_scratch: each thread's rows decoded to bf16 (_cpu_step.c moe_glu: 16 gate/up rows or 32
    down rows at a time; _cpu_bf16.c: a unit's 4 * BPR gate and up rows, or 4 * BPR down rows), for the most threads
    a call can use. The engine counts it in its fixed scratch (engine._scratch_bytes) rather than in the call's cap,
    so that a coded expert's rows are split into the same calls, on the same kernels, as its bf16 twin's."""
    return _MAX_THREADS * 2 * (max(_GLU_ROWS, 32, 2 * 4 * _BPR) * widest + 32) + 192


def glu_scratch_cap(inter: int, k_in: int, d_out: int) -> int:
    """Scratch one moe_glu_bf16 native call may allocate: one expert's weights in fp32 (what the engine's fixed
    compute scratch holds for an expert, engine._scratch_bytes), and at least one panel of rows of one expert."""
    return max(4 * (2 * inter * k_in + d_out * inter), glu_call_scratch([_PAD], inter, k_in))


_MAX_THREADS = 16  # _cpu.c MAX_THREADS: the most threads (parts) one native call runs on
_BPR = 8  # _cpu_bf16.c's widest BPR (weight rows per register tile); its units are 4 * BPR rows
_PAD = 32  # the widest row padding (GW) and panel (PANEL) of _cpu.c on any instruction set
_GLU_ROWS, _PR = 16, 6  # _cpu_step.c's pass-1 rows per unit, _cpu_panel.c's weight rows per register tile
_GLU_ROWS_FEW = 256  # _cpu_step.c's pass-1 rows per unit when every expert of a call takes under _PANEL_MIN_T rows
_PANEL_MIN_T = 16  # _cpu_panel.c's PANEL_MIN_T: an expert with this many pairs takes the panel kernel


def glu_call_scratch(counts: Sequence[int], inter: int, k_in: int, bf16: bool = False, pairs: bool = False) -> int:
    """An upper bound of the bytes ms_moe_glu_bf16 mallocs for experts routed counts[e] (token, slot) pairs each
    (_cpu_step.c's arithmetic, paddings rounded up): per pair its routing entry, its prepared input and hidden
    rows and their panel copies; per expert a panel's padding; per thread the pass-1 rows of the largest expert
    and a panel packing buffer. bf16: ms_bf16dot_glu's (_cpu_bf16.c: routing entries, bf16 x and h panels).
    pairs: ms_moe_glu_bf16_pairs' (every expert on the panel kernel, a pair index per pair)."""
    return _call_scratch(sum(counts), len(counts), max(counts, default=0), inter, k_in, bf16, pairs)


def _call_scratch(n_pairs: int, experts: int, largest: int, inter: int, k_in: int, bf16: bool, pairs: bool) -> int:
    """glu_call_scratch from the call's totals: its pairs, experts and largest expert's pairs."""
    if bf16:
        return _scratch_bf16(n_pairs, experts, largest, inter, k_in)
    return _scratch(n_pairs, experts, largest, inter, k_in, pairs)


def _scratch(pairs: int, experts: int, largest: int, inter: int, k_in: int, every_panel: bool = False) -> int:
    """glu_call_scratch for `pairs` pairs over `experts` experts, the largest taking `largest`. A panel's padding
    is counted only for the experts that can take the panel kernel (at most one in _PANEL_MIN_T pairs, and none
    when the largest takes fewer): a 16-token step over 56 of 64 peer experts counted 56 paddings (11 MB, past
    the cap) and ran as three calls where one fits. every_panel: the batch-invariant call (all experts on panels)."""
    wide, threads = max(inter, k_in), max(1, cpu.threads())
    per_pair = 20 + 4 * (k_in + inter + 2 * _PAD) + 4 * (k_in + inter)
    if every_panel:
        panels = experts
    else:
        panels = min(experts, pairs // _PANEL_MIN_T) if largest >= _PANEL_MIN_T else 0
    unit = _GLU_ROWS_FEW if largest < _PANEL_MIN_T else _GLU_ROWS
    per_thread = 4 * (2 * unit * largest + 2 * _PR * (wide + _PAD))
    return pairs * per_pair + experts * 40 + panels * 4 * _PAD * (k_in + inter) + threads * per_thread + 256


def _scratch_bf16(pairs: int, experts: int, largest: int, inter: int, k_in: int) -> int:
    """glu_call_scratch of the bf16 compute path: per pair its routing entry and its bf16 x and h panel words, per
    expert its bookkeeping and a panel's padding (no per-thread buffers: the tiles live on the stack)."""
    return pairs * (12 + 2 * (k_in + inter)) + experts * (32 + 2 * cpu.bf16_panel() * (k_in + inter)) + 256


def _pair_counts(experts: Sequence[int], ids: Tensor | None, t: int) -> list[int]:
    if ids is None:
        return [t] * len(experts)
    flat = ids.reshape(-1)
    flat = flat[flat >= 0]  # a slot no expert takes
    hist = torch.bincount(flat, minlength=max(experts, default=0) + 1).tolist()
    return [hist[e] if 0 <= e < len(hist) else 0 for e in experts]


def _expert_groups(counts: list[int], inter: int, k_in: int, cap: int, bf16: bool = False,
                   pairs: bool = False) -> list[list[int]]:
    """Consecutive runs of expert indices whose call fits `cap` (a run of one may not: the caller splits it).
    glu_call_scratch of the run so far, from its running pair count, length and largest count."""
    groups: list[list[int]] = []
    total = largest = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        if groups and _call_scratch(total + n, len(groups[-1]) + 1, max(largest, n), inter, k_in, bf16, pairs) <= cap:
            groups[-1].append(e)
            total, largest = total + n, max(largest, n)
        else:
            groups.append([e])
            total = largest = n
    return groups


def _token_ranges(expert: int, ids: Tensor | None, t: int, count: int, inter: int, k_in: int,
                  cap: int, bf16: bool = False, pairs: bool = False) -> list[tuple[int, int]]:
    """Token ranges [lo, hi) splitting `expert`'s `count` pairs evenly into as few calls as fit `cap`. Even, so
    that no range is left with fewer rows than the panel kernel takes (an expert's rows then meet the same
    kernel, whose per-token sums do not depend on how tokens are grouped). bf16: never fewer rows a range than the
    row kernel's limit (ms_bf16dot_row_limit), even where that passes a cap too small for so many rows."""
    per = 1
    while per < count and glu_call_scratch([2 * per], inter, k_in, bf16, pairs) <= cap:
        per *= 2
    n = -(-count // per)
    if bf16:
        n = min(n, max(1, count // max(1, cpu.lib().ms_bf16dot_row_limit())))
    if ids is None:
        cuts = [t * i // n for i in range(n + 1)]
        return [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
    cum = torch.cumsum((ids == expert).sum(1), 0)
    # after the first token whose running count reaches each i/n of the pairs
    cuts = [0] + [int(torch.searchsorted(cum, count * i // n)) + 1 for i in range(1, n)] + [t]
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


class _GluCall:
    """One ms_moe_glu_bf16 (or, bf16, ms_bf16dot_glu) call over a subset of the experts (addresses gathered once)."""

    def __init__(self, experts: Sequence[int], parts: Sequence[tuple[int, int, int]], inter: int, k_in: int,
                 d_out: int, act: str, beta: float, linear_beta: float, bf16: bool = False, pairs: bool = False):
        self.experts, self.parts, self.inter, self.k_in, self.d_out = list(experts), list(parts), inter, k_in, d_out
        self.act, self.beta, self.linear_beta, self.bf16 = ACTIVATIONS[act], beta, linear_beta, bf16
        self.pairs = pairs  # out is [T, k, D]: ms_moe_glu_bf16_pairs
        self.workspace: Tensor | None = None  # bf16: scratch the calls share (ms_bf16dot_glu_ws), else their own

    def __call__(self, which, x: Tensor, ids: Tensor | None, scores: Tensor | None, out: Tensor) -> None:
        which = list(which)
        handle = required()
        args = (len(which), _addresses([self.experts[i] for i in which]),
                _addresses([self.parts[i][0] for i in which]), _addresses([self.parts[i][1] for i in which]),
                _addresses([self.parts[i][2] for i in which]), self.inter, self.k_in, self.d_out, x.data_ptr(),
                x.shape[0], None if ids is None else ids.data_ptr(), None if scores is None else scores.data_ptr(),
                0 if ids is None else ids.shape[1], out.data_ptr(), self.act, self.beta, self.linear_beta)
        if self.bf16:
            ws = self.workspace
            code = handle.ms_bf16dot_glu_ws(*args, None if ws is None else ws.data_ptr(),
                                            0 if ws is None else ws.numel())
        else:
            code = (handle.ms_moe_glu_bf16_pairs if self.pairs else handle.ms_moe_glu_bf16)(*args)
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


def rms_norm(x: Tensor, w: Tensor | None, eps: float, out: Tensor | None = None) -> Tensor:
    """rms_norm over the last dim of a contiguous fp32 x [..., H], times w (fp32 or bf16 [H]) when given; into
    `out` (contiguous fp32, x's shape; x itself for in place) when given."""
    handle = required()
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("native rms_norm wants a contiguous fp32 x")
    if out is None:
        out = torch.empty_like(x)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.shape != x.shape:
        raise ValueError("native rms_norm's out must be a contiguous fp32 tensor of x's shape")
    h = x.shape[-1]
    ptr, bf16 = norm_weight(w)
    handle.ms_rms_norm(x.data_ptr(), x.numel() // max(1, h), h, ptr, bf16, eps, out.data_ptr())
    return out


def qk_prep(kernel: str, d: int, q_norm: Tensor | None, k_norm: Tensor | None,
            inv_freq: Tensor | None) -> tuple[int | None, int | None, int, int | None]:
    """The attention kernels' q/k norm and rope operands checked: (q_norm address, k_norm address, 1 if the norms
    are bf16, inv_freq address); None for what is not given. ValueError for mismatched ones."""
    if inv_freq is not None and (inv_freq.dtype != torch.float32 or inv_freq.numel() * 2 != d):
        raise ValueError(f"{kernel} wants fp32 inv_freq [D/2]")
    qn, qbf16 = norm_weight(q_norm)
    kn, kbf16 = norm_weight(k_norm)
    if q_norm is not None and k_norm is not None and qbf16 != kbf16:
        raise ValueError(f"{kernel} wants q_norm and k_norm of one dtype")
    return qn, kn, qbf16 or kbf16, None if inv_freq is None else inv_freq.data_ptr()


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
    qn, kn, nbf16, freq = qk_prep("gqa_attend", d, q_norm, k_norm, inv_freq)
    out = torch.empty(t, hq, dv, dtype=torch.float32)
    if handle.ms_gqa_attend(t, hq, hkv, d, dv, q.data_ptr(), keys.data_ptr(), values.data_ptr(), length, qn, kn,
                            nbf16, eps, freq, factor, scale, window or 0, out.data_ptr()):
        raise MemoryError("native attention could not allocate its scores")
    return out



PREFETCH_BYTES = 8 << 20  # at most this much of the weights a region list names: the L3 holds the start of them


def prefetch_regions(tensors: Sequence[Tensor], limit: int = PREFETCH_BYTES) -> ctypes.Array:
    """pool_prefetch's operand for the start of these tensors' storage, in order, `limit` bytes in all: int64
    [n, address, bytes, ...]. The caller keeps the tensors alive while the array is in use."""
    flat: list[int] = []
    for t in tensors:
        nbytes = min(t.numel() * t.element_size(), limit)
        if nbytes <= 0 or not t.is_contiguous():
            continue
        flat += [t.data_ptr(), nbytes]
        limit -= nbytes
    return _addresses([len(flat) // 2, *flat])


def prefetch(regions: ctypes.Array | None) -> None:
    """The native pool's workers read these regions (prefetch_regions) into the cache in the background, while the
    caller goes on; the next native call stops them. Nothing without native kernels or with one thread."""
    if regions is not None and (handle := lib()) is not None:
        handle.ms_prefetch_async(regions)


# ms_gqa_decode_block's cfg slots (the enum in _cpu_layer.c)
_DL_SLOTS = ("hidden", "heads", "kv_heads", "head_dim", "v_dim", "in_norm", "in_bf16", "wq", "wk", "wv", "wo",
             "q_norm", "k_norm", "qk_bf16", "inv_freq", "window", "post_norm", "post_bf16", "router", "experts",
             "top_k", "renorm", "block", "min_rows", "inter", "act", "prefetch")
_DLF_BETA = 3  # fcfg slots of the table's activation (DLF_BETA, DLF_LBETA)
_DL_INTER, _DL_ACT = _DL_SLOTS.index("inter"), _DL_SLOTS.index("act")


class ExpertTable:
    """The resident bf16 GLU experts of one MoE layer, as the native decode layer reads them: E rows of (gate, up,
    down) addresses, 0 for an expert that is not resident. Its owner (the expert runner) fills a row when an
    expert is used from the cache and clears it when the expert is evicted, so a non-zero row always points at a
    live buffer. `parts_of` maps an expert's tensors to (gate, up, down, inter, in, out) or None (blocks.glu_parts);
    the first expert filled sets the intermediate width, and experts of another shape or format are never filled
    (a token routed to one takes the general path)."""

    def __init__(self, experts: int, hidden: int, act: str, beta: float, linear_beta: float,
                 parts_of: Callable[[Mapping[str, Tensor]], tuple | None]):
        self.experts, self.inter, self.hidden = experts, 0, hidden
        self.act, self.beta, self.linear_beta = ACTIVATIONS[act], beta, linear_beta
        self.rows = (ctypes.c_int64 * (3 * experts))()
        self.parts_of = parts_of
        self.used = 0  # layer steps whose routed experts ran from this table
        self._calls: dict[tuple, bool] = {}  # one_call's answers

    def fill(self, e: int, tensors: Mapping[str, Tensor]) -> None:
        if self.rows[3 * e]:
            return
        got = self.parts_of(tensors)
        if got is not None and got[4:] == (self.hidden, self.hidden) and got[3] == (self.inter or got[3]):
            self.inter = got[3]
            self.rows[3 * e], self.rows[3 * e + 1], self.rows[3 * e + 2] = got[:3]

    def drop(self, e: int) -> None:
        self.rows[3 * e] = self.rows[3 * e + 1] = self.rows[3 * e + 2] = 0

    def one_call(self, rows: int, top_k: int) -> bool:
        """Whether moe_glu_bf16 (fp32 compute) runs any routing of `rows` rows, top_k each, over this table's
        experts as one native call (its first test: the scratch the most pairs per expert could need fits the cap),
        as the native rows block runs them (DecodeBlock.rows)."""
        key = (rows, top_k, self.inter, cpu.threads())  # what the answer depends on (asked once a layer step)
        got = self._calls.get(key)
        if got is None:
            inter, k_in = self.inter, self.hidden
            got = self._calls[key] = bool(inter) and _call_scratch(
                rows * top_k, min(self.experts, rows * top_k), rows, inter, k_in, False, False) \
                <= glu_scratch_cap(inter, k_in, k_in)
        return got


class DecodeBlock:
    """The attention half of one GQA decoder layer for one decode token, in one native call
    (ms_gqa_decode_block): rms_norm -> q/k/v GEMVs (k, v written into the cache row the caller appended) -> q/k
    rms_norm and rotate-half rope -> attention over the cache's blocks -> o_proj -> residual add, then the
    post-attention rms_norm and, with a router, its softmax top-k. The same pieces in the same order as the
    separate calls (rms_norm, linear_many, gqa_attend, linear, router_softmax_topk), so the same values bit for
    bit. `rows` does the same half (and the router) for a short prompt chunk of one sequence. Holds the layer's
    tensors (their addresses are baked into the call's operands)."""

    def __init__(self, weights: dict[str, Tensor | None], heads: int, kv_heads: int, head_dim: int, eps: float,
                 factor: float, scale: float, window: int | None, block: int, top_k: int = 0,
                 renormalize: bool = False, min_rows: int = MIN_ROWS_PER_THREAD):
        ops = {}  # (address, N, K) of each: bf16, or b12-coded (tagged)
        for name in "qkvo":
            try:
                ops[name] = cpu.dense_operand(weights[name])
            except ValueError as e:
                raise ValueError(f"DecodeBlock wants a contiguous bf16 {name} weight: {e}") from None
        hidden = ops["q"][2]
        shapes = {"q": (heads * head_dim, hidden), "k": (kv_heads * head_dim, hidden),
                  "v": (kv_heads * head_dim, hidden), "o": (hidden, heads * head_dim)}
        for name, shape in shapes.items():
            if ops[name][1:] != shape:
                raise ValueError(f"DecodeBlock wants a contiguous bf16 {name} weight {shape}, got {ops[name][1:]}")
        router = weights.get("router")
        if router is not None and (router.dtype != torch.bfloat16 or not router.is_contiguous()
                                   or router.dim() != 2 or router.shape[1] != hidden
                                   or not 0 < top_k <= router.shape[0]):
            raise ValueError(f"DecodeBlock wants a contiguous bf16 router [E, {hidden}] and 0 < top_k <= E")
        inv_freq = weights.get("inv_freq")
        if inv_freq is not None and not inv_freq.is_contiguous():
            raise ValueError("DecodeBlock wants a contiguous inv_freq")
        qn, kn, qk_bf16, freq = qk_prep("DecodeBlock", head_dim, weights.get("q_norm"), weights.get("k_norm"),
                                        inv_freq)
        in_norm, in_bf16 = norm_weight(weights["in_norm"])
        post_norm, post_bf16 = norm_weight(weights["post_norm"])
        self.hidden, self.top_k, self.heads, self.kv_heads, self.head_dim = hidden, top_k, heads, kv_heads, head_dim
        self._keep = dict(weights)  # the addresses below stay valid while this object lives
        vals = {"hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "v_dim": head_dim,
                "in_norm": in_norm, "in_bf16": in_bf16, "wq": ops["q"][0], "wk": ops["k"][0],
                "wv": ops["v"][0], "wo": ops["o"][0], "q_norm": qn, "k_norm": kn, "qk_bf16": qk_bf16,
                "inv_freq": freq, "window": window or 0,
                "post_norm": post_norm, "post_bf16": post_bf16,
                "router": None if router is None else router.data_ptr(),
                "experts": 0 if router is None else router.shape[0], "top_k": top_k, "renorm": int(renormalize),
                "block": block, "min_rows": min_rows}
        self._cfg = _addresses([vals.get(n) or 0 for n in _DL_SLOTS])  # inter, act: set per call
        self._fcfg = (ctypes.c_float * 5)(eps, factor, scale, 0.0, 0.0)
        self._experts = router.shape[0] if router is not None else 0
        self._after: tuple[list[Tensor], ctypes.Array] | None = None

    def prefetch_after(self, tensors: Sequence[Tensor]) -> None:
        """After each call the pool's workers read the start of these tensors (the next layer's weights) ahead
        while the caller's Python runs; this object keeps them alive."""
        regions = prefetch_regions(tensors)
        self._after = (list(tensors), regions)
        self._cfg[_DL_SLOTS.index("prefetch")] = ctypes.addressof(regions)

    def __call__(self, h: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], start: int, length: int,
                 table: ExpertTable | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, bool]:
        """h fp32 [1, H] -> (h after attention and residual (a new tensor), the post-norm x2 [1, H], with a
        router its ids int64 [1, k] and weights fp32 [1, k], and whether the MoE half was done too). keys /
        values: the cache's fp32 blocks [block, Hkv, D], holding absolute rows [start, length), the last one
        appended (its contents are written here). With a router and an ExpertTable of its experts that holds
        every expert the token routes to, h also gets the routed experts' weighted sum (flag True)."""
        handle = required()
        if h.dtype != torch.float32 or h.shape != (1, self.hidden):
            raise ValueError(f"DecodeBlock wants fp32 h [1, {self.hidden}], got {tuple(h.shape)} {h.dtype}")
        out = h.clone(memory_format=torch.contiguous_format)
        x2 = torch.empty(1, self.hidden)
        ids = wts = None
        if self.top_k:
            ids, wts = torch.empty(1, self.top_k, dtype=torch.int64), torch.empty(1, self.top_k)
        rows = None
        if table is not None and ids is not None:
            self.check_table(table)
            self.use_table(table)
            rows = table.rows
        code = handle.ms_gqa_decode_block(self._cfg, self._fcfg, out.data_ptr(),
                                          _addresses([b.data_ptr() for b in keys]),
                                          _addresses([b.data_ptr() for b in values]), start, length,
                                          x2.data_ptr(), None if ids is None else ids.data_ptr(),
                                          None if wts is None else wts.data_ptr(), rows)
        if code < 0:
            raise MemoryError("native decode block could not allocate its scratch") if code == -1 else \
                ValueError(f"DecodeBlock: bad cache rows [{start}, {length})")
        return out, x2, ids, wts, code == 1

    def rows(self, h: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], start: int, length: int,
             table: ExpertTable | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, bool]:
        """The attention half and router for T new tokens of one sequence (a short prompt chunk) in one native
        call (ms_gqa_rows_block): h fp32 [T, H] -> (h after attention and residual (a new tensor), the post-norm x2
        [T, H], with a router its ids int64 [T, k] and weights fp32 [T, k], and whether the MoE half was done too).
        The cache's blocks hold absolute rows [start, length), the last T appended (their contents are written
        here); blocks[0] must start at or before the first key the first new token sees. The same values as
        rms_norm, linear_many, gqa_attend, linear, the residual add, rms_norm and router_softmax_topk called one by
        one, bit for bit. With a router and an ExpertTable of its experts that holds every expert the rows route
        to, h also gets the routed experts' weighted sum as one grouped native call computes it (flag True); the
        caller passes a table only where the runner's grouped call would be that one call (ExpertTable.one_call)."""
        handle = required()
        t = h.shape[0] if h.dim() == 2 else 0
        if h.dtype != torch.float32 or h.shape != (t, self.hidden) or t < 1:
            raise ValueError(f"DecodeBlock.rows wants fp32 h [T, {self.hidden}], got {tuple(h.shape)} {h.dtype}")
        out = h.clone(memory_format=torch.contiguous_format)
        x2 = torch.empty(t, self.hidden)
        ids = wts = None
        rows = None
        if self.top_k:
            ids, wts = torch.empty(t, self.top_k, dtype=torch.int64), torch.empty(t, self.top_k)
            if table is not None:
                self.check_table(table)
                self.use_table(table)
                rows = table.rows
        code = handle.ms_gqa_rows_block(self._cfg, self._fcfg, t, out.data_ptr(),
                                        _addresses([b.data_ptr() for b in keys]),
                                        _addresses([b.data_ptr() for b in values]), start, length, x2.data_ptr(),
                                        None if ids is None else ids.data_ptr(),
                                        None if wts is None else wts.data_ptr(), rows)
        if code < 0:
            raise MemoryError("native attention rows could not allocate their scratch") if code == -1 else \
                ValueError(f"DecodeBlock.rows: bad cache rows [{start}, {length}) for {t} new tokens")
        return out, x2, ids, wts, code == 1

    def check_table(self, table: ExpertTable) -> None:
        if table.experts != self._experts or table.hidden != self.hidden:
            raise ValueError(f"DecodeBlock: an expert table of {table.experts} experts x {table.hidden} for a "
                             f"router of {self._experts} x {self.hidden}")

    def use_table(self, table: ExpertTable) -> None:
        """The table's intermediate width (set by its first expert) and activation into the call's operands."""
        cfg = self._cfg
        if cfg[_DL_INTER] != table.inter or cfg[_DL_ACT] != table.act:
            cfg[_DL_INTER], cfg[_DL_ACT] = table.inter, table.act
            self._fcfg[_DLF_BETA], self._fcfg[_DLF_BETA + 1] = table.beta, table.linear_beta


_DS_COUNT = 7  # ms_gqa_decode_layers' int64 record per layer: cfg, fcfg, keys, values, start, length, table (DS_*)
_DS_KB, _DS_START, _DS_LENGTH = 2, 4, 5


class DecodeLayers:
    """Consecutive GQA decoder layers of one decode token in one native call (ms_gqa_decode_layers): each layer
    what its DecodeBlock computes with its router's ExpertTable (attention half, router, routed experts), h carried
    from layer to layer in C, so the layers of a warm step cost one call instead of one call and its Python each.
    Keeps per layer the operand record, the cache's block address arrays (rebuilt when the cache gains or drops a
    block) and the outputs: post-norm x2 [L, H], ids int64 [L, k] and weights fp32 [L, k]."""

    def __init__(self, blocks: Sequence[DecodeBlock], tables: Sequence[ExpertTable]):
        shapes = {(b.hidden, b.top_k) for b in blocks}
        if not blocks or len(blocks) != len(tables) or len(shapes) != 1 or not blocks[0].top_k:
            raise ValueError("DecodeLayers wants one or more DecodeBlocks with routers of one width and top-k, "
                             "and a table each")
        for b, t in zip(blocks, tables):
            b.check_table(t)
        n, (hidden, top_k) = len(blocks), shapes.pop()
        self.blocks, self.tables = list(blocks), list(tables)
        self.x2 = torch.empty(n, hidden)
        self.ids = torch.empty(n, top_k, dtype=torch.int64)
        self.wts = torch.empty(n, top_k)
        self._rec = (ctypes.c_int64 * (n * _DS_COUNT))()
        for i, (b, t) in enumerate(zip(blocks, tables)):
            at = i * _DS_COUNT
            self._rec[at], self._rec[at + 1] = ctypes.addressof(b._cfg), ctypes.addressof(b._fcfg)
            self._rec[at + 6] = ctypes.addressof(t.rows)
        self._kv: list[tuple | None] = [None] * n  # per layer: (keys, versions, values, their block addresses)
        self.runs = 0  # native calls made

    def __len__(self) -> int:
        return len(self.blocks)

    def set_cache(self, i: int, keys, values) -> None:
        """Layer i's cache for the next call: `keys` / `values` hold `blocks` (fp32 [block, Hkv, D] tensors),
        `start` (blocks[0]'s absolute row), `length` (rows, the appended one included) and `version` (changed
        whenever `blocks` changes, memory.state.BlockBuffer), so the object and its version name the block list
        (the object is kept, so no other takes its id)."""
        at = i * _DS_COUNT
        got = self._kv[i]
        if got is None or got[0] is not keys or got[1] != (keys.version, values.version) or got[2] is not values:
            got = self._kv[i] = (keys, (keys.version, values.version), values,
                                 _addresses([b.data_ptr() for b in keys.blocks]),
                                 _addresses([b.data_ptr() for b in values.blocks]))
            self._rec[at + _DS_KB], self._rec[at + _DS_KB + 1] = ctypes.addressof(got[3]), ctypes.addressof(got[4])
            self._rec[at + _DS_START] = keys.start
        self._rec[at + _DS_LENGTH] = keys.length

    def __call__(self, h: Tensor, first: int = 0, end: int | None = None) -> int:
        """Layers [first, end) on h fp32 [1, H] (contiguous, updated in place), their caches set (`set_cache`).
        Returns the layer after the last one done whole: `end`, or a layer i that routed to an expert its table
        lacks, whose attention half and router are done (h, x2[i], ids[i], wts[i]) and whose experts are left
        to the caller."""
        handle = required()
        end = len(self.blocks) if end is None else end
        if h.dtype != torch.float32 or h.shape != (1, self.x2.shape[1]) or not h.is_contiguous():
            raise ValueError(f"DecodeLayers wants fp32 contiguous h [1, {self.x2.shape[1]}], got {tuple(h.shape)}")
        if not 0 <= first < end <= len(self.blocks):
            raise ValueError(f"DecodeLayers: layers [{first}, {end}) of {len(self.blocks)}")
        for b, t in zip(self.blocks[first:end], self.tables[first:end]):
            b.use_table(t)
        k = self.ids.shape[1]
        self.runs += 1
        code = handle.ms_gqa_decode_layers(end - first, ctypes.addressof(self._rec) + first * _DS_COUNT * 8,
                                           h.data_ptr(), self.x2[first].data_ptr(), self.ids.data_ptr() + first * k * 8,
                                           self.wts[first].data_ptr())
        if code < 0:
            raise MemoryError("native decode layers could not allocate their scratch") if code == -1 else \
                ValueError("DecodeLayers: bad cache rows")
        return first + code
