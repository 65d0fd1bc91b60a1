"""Building blocks shared by the model families: norms, projections, activations, routers, expert MLPs.

Owns the math that several families share, in fp32 activations (weights are upcast per use, so a bf16
checkpoint computes what its fp32 expansion computes). It does not know about checkpoints, caches or state.

The opt-in bf16 compute path (EngineOptions.compute_dtype "bf16", set for a step by `compute_dtype`): products of
a bf16 weight over many rows (a step of at least BF16_MIN_ROWS rows: prefill chunks, batch steps) multiply the
stored weight by the activations rounded to bf16, summing in fp32 (kernels/_cpu_bf16.c): dense projections,
shared experts and lm_head through `linear` / `linear_many`, and the routed experts' grouped GLU calls from
BF16_GLU_MIN_ROWS rows (the same 16). MXFP4 products (K3's and gpt-oss's experts) round their activations to
bf16 at every row count, one-token decode included (`mxfp4_bf16`). Routers stay fp32 (a bf16 router logit can
flip an expert choice), and so do other products of fewer rows (one-token decode keeps its kernels), fp32 and
other quantised weights, and everything without the native kernels.
Each output row then depends on its own input row, and in the routed experts on whether its expert took fewer
than 16 rows of the call (which kernel runs it, fused.moe_glu_bf16), so splitting a step's rows into calls (or the
lm_head into slabs; an expert's rows are never split below 16) changes nothing; which precision a row gets depends
on its step's row count.
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F

from moestream.config import COMPUTE_DTYPE_NAMES
from moestream.errors import MoestreamError
from moestream.experts.store import cached_addresses
from moestream.kernels import cpu, fused, invariant
from moestream.kernels.b12 import B12Weight
from moestream.kernels.qweight import QuantWeight
from moestream.memory.state import scratch

if TYPE_CHECKING:
    from moestream.memory.accountant import MemoryAccountant


UPCAST_CHUNK_BYTES = 16 << 20  # fp32 scratch for one slab of upcast weight rows (counted in the engine's scratch)
# bf16 compute from this many rows of a step: at 16 rows a 1024 x 1024 product ran 286 GFLOP/s in bf16 against
# 145 through the fp32 native kernel, at 8 rows both 123 (docs/performance.md, "bf16 compute")
BF16_MIN_ROWS = 16
# ... and the routed experts' GLU from this many. It was 64 (a 16-row step's experts take ~2 rows each, where the
# panels' lanes were mostly idle: 39 GFLOP/s against 68); since the row kernel (_cpu_bf16.c brk_rows) takes an
# expert of fewer than 16 rows, warm peer_b12 prefills under bf16 compute ran 16 / 32 / 48 tokens at 78.4 / 111.6 /
# 135.9 tok/s with the threshold at 16 against 68.1 / 88.9 / 100.0 at 64, alternated in one process (8 tokens, below
# both: 67.0 / 67.6; docs/performance.md)
BF16_GLU_MIN_ROWS = BF16_MIN_ROWS

_COMPUTE: contextvars.ContextVar[tuple[str, "MemoryAccountant | None"]] = contextvars.ContextVar(
    "moestream_compute_dtype", default=("fp32", None))


def check_compute_dtype(name: str) -> str:
    """`name` when it is a --compute-dtype choice; a MoestreamError naming the choices otherwise."""
    if name not in COMPUTE_DTYPE_NAMES:
        raise MoestreamError(f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPE_NAMES)}; got {name!r}")
    return name


@contextlib.contextmanager
def compute_dtype(name: str, memory: "MemoryAccountant | None" = None) -> Iterator[None]:
    """Within the block (this thread / context only), `linear`, `linear_many` and the GLU experts compute many-row
    products in `name` ("fp32" or "bf16"); `memory` is charged for the bf16 rows' scratch beyond its allowance."""
    token = _COMPUTE.set((check_compute_dtype(name), memory))
    try:
        yield
    finally:
        _COMPUTE.reset(token)


def mxfp4_bf16() -> bool:
    """Whether MXFP4 products round their activations to bf16 (kernels/_cpu_bf16.c ms_linear_mxfp4_bf16): under
    compute_dtype("bf16"), at every row count, one-token decode included (K3's routed experts in a warm decode
    1.4-1.5x faster, where bf16 weights' one-token rows gained 0-10%; docs/performance.md)."""
    return _COMPUTE.get()[0] == "bf16"


def _bf16_rows(rows: int, least: int = BF16_MIN_ROWS) -> bool:
    return rows >= least and _COMPUTE.get()[0] == "bf16"


def _bf16_weight(w: torch.Tensor, k_in: int) -> bool:
    if type(w) is B12Weight:
        return w.in_features == k_in and k_in % 2 == 0
    return (type(w) is torch.Tensor and w.dtype == torch.bfloat16 and w.dim() == 2 and w.is_contiguous()
            and w.shape[1] == k_in and k_in % 2 == 0)


def _bf16_linear(x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
    """[bf16(x) @ w^T] in one native call when the bf16 compute path applies to x and every w, else None."""
    if x.dim() < 1 or x.requires_grad or not all(_bf16_weight(w, x.shape[-1]) for w in ws):
        return None
    rows = x.numel() // max(1, x.shape[-1])
    if not _bf16_rows(rows) or not cpu.available():
        return None
    memory, coded = _COMPUTE.get()[1], any(type(w) is B12Weight for w in ws)
    with (scratch(memory, cpu.bf16dot_scratch(rows, x.shape[-1], coded), "bf16 activation rows")
          if memory is not None else contextlib.nullcontext()):
        ys = cpu.linear_bf16dot_many(x, ws)
    return [y.view(*x.shape[:-1], y.shape[-1]) for y in ys]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, fp32: bool = False) -> torch.Tensor:
    """x [T, in] fp32 @ w[out, in]^T (+ b), fp32 out.

    Under compute_dtype("bf16") (and not `fp32`: the routers), a bf16 weight over BF16_MIN_ROWS+ rows multiplies
    bf16-rounded rows natively with fp32 sums (the module docstring).
    A 2-D bf16 weight with at most cpu.MAX_TOKENS_BF16 rows of x goes to the native kernel (no upcast at all).
    A quantised weight (block-FP8, int4: kernels/qweight.py) is decoded a bounded chunk of rows at a time.
    Otherwise a half-precision weight larger than the slab is upcast slab by slab into a bounded scratch, never as
    a whole fp32 copy: a whole copy of K3's lm_head would be a 4.7 GiB temporary outside the RAM budget.
    """
    if b is not None and b.dtype != torch.float32:
        b = b.float()
    if type(w) is B12Weight and cpu.available() and not x.requires_grad:
        y = _b12_linear(x, w, fp32)
        return y if b is None else y + b
    if isinstance(w, QuantWeight):
        y = w.linear(x)
        return y if b is None else y + b
    if invariant.active() and not x.requires_grad and cpu.fixed_weight(w, x.shape[-1]) and cpu.available():
        memory, rows = _COMPUTE.get()[1], x.numel() // max(1, x.shape[-1])
        with (scratch(memory, cpu.fixed_scratch(rows, x.shape[-1]), "fixed-order input panels")
              if memory is not None else contextlib.nullcontext()):
            y = cpu.linear_fixed(x, w)  # one fixed summation order for any row count (kernels/invariant.py)
        return y if b is None else y + b
    if not fp32 and (got := _bf16_linear(x, (w,))) is not None:
        return got[0] if b is None else got[0] + b
    if cpu.bf16_native(w, x):
        y = cpu.linear_bf16(x, w)
        return y if b is None else y + b
    if w.dtype == torch.float32:
        return F.linear(x, w, b)
    if w.shape[0] <= _upcast_rows(w.shape[-1]) or type(w) is not torch.Tensor or w.dim() != 2:
        return F.linear(x, w.float(), b)
    out = _upcast_linear(x, w.shape[0], lambda slab, r: slab.copy_(w[r:r + slab.shape[0]]))
    return out if b is None else out + b


def _upcast_rows(k_in: int) -> int:
    return max(1, UPCAST_CHUNK_BYTES // (4 * k_in))


def _upcast_linear(x: torch.Tensor, n_out: int, fill: Callable[[torch.Tensor, int], object]) -> torch.Tensor:
    """x @ W^T for a half-precision W of n_out rows, upcast a slab of _upcast_rows rows at a time into one fp32
    scratch (`fill(slab, r)` writes rows [r, r + len(slab)) of W into slab)."""
    xt = x.reshape(-1, x.shape[-1]).T  # [in, T]
    out_t = torch.empty(n_out, xt.shape[1], dtype=torch.float32)  # [out, T]: slabs fill contiguous rows
    rows = _upcast_rows(x.shape[-1])
    upcast = torch.empty(min(rows, n_out), x.shape[-1], dtype=torch.float32)
    for r in range(0, n_out, rows):
        slab = upcast[:min(rows, n_out - r)]
        fill(slab, r)
        torch.mm(slab, xt, out=out_t[r:r + slab.shape[0]])
    return out_t.T.reshape(*x.shape[:-1], n_out)


B12_SLAB_BYTES = 2 << 20  # bf16 bytes of a b12 weight's rows decoded at a time by _b12_linear's decoding paths


def _b12_linear(x: torch.Tensor, w: B12Weight, fp32: bool) -> torch.Tensor:
    """`linear` for a b12-coded bf16 weight, the very values the bf16 matrix gives on each path: up to
    cpu.MAX_TOKENS_BF16 rows (fp32 compute) the native kernel reads the coded bytes; in bf16 compute the bf16 kernel
    decodes a block of rows at a time into a thread's scratch (cpu.linear_bf16dot_many); on the other paths (the
    fixed-order kernel, the upcast slabs) rows are decoded a bounded slab at a time and take the bf16 matrix's path,
    whose outputs do not depend on which other weight rows share the call."""
    n, k = w.out_features, w.in_features
    tokens = x.numel() // max(1, x.shape[-1])
    if _native_dense(w, x, fp32):
        return cpu.linear_bf16_many(x, [w])[0].view(*x.shape[:-1], n)
    if not invariant.active() and (fp32 or not _bf16_rows(tokens)):
        if n <= _upcast_rows(k):
            return F.linear(x, w.float())
        return _upcast_linear(x, n, lambda slab, r: w.expand_rows_into(r, slab))
    if not invariant.active() and not fp32 and (got := _bf16_linear(x, (w,))) is not None:
        return got[0]  # bf16 compute: the coded rows decoded a block at a time inside the native call
    out = torch.empty(tokens, n, dtype=torch.float32)
    step = max(1, B12_SLAB_BYTES // (2 * k))
    dec = torch.empty(min(step, n), k, dtype=torch.bfloat16)
    for r in range(0, n, step):
        rows = cpu.b12_decode_rows(w.codes, n, k, r, min(n, r + step), dec[:min(step, n - r)])
        out[:, r:r + rows.shape[0]] = linear(x, rows, fp32=fp32).reshape(tokens, -1)
    return out.view(*x.shape[:-1], n)


def _native_dense(w: torch.Tensor, x: torch.Tensor, fp32: bool = False) -> bool:
    """Whether `linear(x, w, fp32=fp32)` multiplies x by w with the native bf16 kernel (w bf16, or b12-coded),
    whole."""
    if type(w) is B12Weight:
        rows = x.numel() // max(1, x.shape[-1])
        return (w.in_features == x.shape[-1] and not x.requires_grad and cpu.available()
                and rows <= cpu.MAX_TOKENS_BF16 and (fp32 or not _bf16_rows(rows)) and not invariant.active())
    return cpu.bf16_native(w, x) and w.is_contiguous() and w.shape[1] == x.shape[-1]


def native_rows(x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> bool:
    """Whether `linear_many(x, ws)` and `linear(x, w)` multiply x by each w with the native kernel in fp32 compute
    (ms_linear_bf16_many: bf16 or b12-coded weights, up to cpu.MAX_TOKENS_BF16 rows, not the bf16 compute path nor
    the batch-invariant one): what a native call made of the same pieces must match (attention.GQAMixer.rows_block)."""
    rows = x.numel() // max(1, x.shape[-1])
    return not invariant.active() and not _bf16_rows(rows) and all(_native_dense(w, x) for w in ws)


def native_glu_fp32(rows: int) -> bool:
    """Whether the grouped GLU experts of a step of `rows` rows compute in fp32 (ms_moe_glu_bf16), not on the bf16
    compute path: what the native rows block's experts compute (attention.GQAMixer.rows_block)."""
    return not _bf16_rows(rows, BF16_GLU_MIN_ROWS)


def linear_many(x: torch.Tensor, ws: tuple[torch.Tensor, ...],
                bs: tuple[torch.Tensor | None, ...] | None = None) -> list[torch.Tensor]:
    """[linear(x, w, b) for each weight]: one native call for all of them when each would take the native kernel
    (x prepared once; the weights' rows split over the threads together), else one linear each."""
    bs = bs or (None,) * len(ws)
    if invariant.active():
        return [linear(x, w, b) for w, b in zip(ws, bs)]
    if (got := _bf16_linear(x, ws)) is not None:
        return [y if b is None else y + b.float() for y, b in zip(got, bs)]
    if len(ws) > 1 and all(_native_dense(w, x) for w in ws):
        ys = cpu.linear_bf16_many(x, ws)
        return [y if b is None else y + b.float() for y, b in zip(ys, bs)]
    return [linear(x, w, b) for w, b in zip(ws, bs)]


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """w * x / sqrt(mean(x^2) + eps), in fp32. Natively at any row count where it applies: one pass over the rows
    instead of five torch ops (1220 rows x 1024: 1 ms against 6 ms on a quiet machine, and 30 ms when the other
    core is busy and torch's two threads wait on each other). `out`: a buffer the result may be written into (x
    itself for in place) instead of a new tensor, where the native path takes it (contiguous fp32, x's shape, no
    grad); the caller uses the returned tensor either way."""
    if (x.dtype == torch.float32 and x.is_contiguous() and not x.requires_grad and x.numel() > 0
            and type(x) is torch.Tensor
            and (w is None or (w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous()
                               and w.shape == x.shape[-1:] and not w.requires_grad)) and cpu.available()):
        if out is not None and not (out.dtype == torch.float32 and out.is_contiguous() and out.shape == x.shape
                                    and not out.requires_grad and type(out) is torch.Tensor):
            out = None
        return fused.rms_norm(x, w, eps, out)
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w.float() if w is not None else y


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """Kimi K3's SiTU-GLU: [beta tanh(a/beta) sigma(a)] * [lb tanh(u/lb)], fp32. With the native kernels and no
    gradient to keep (inference), one native call (cpu.situ_glu: the same order of operations, tanh and sigmoid
    from the kernels' own exponential, as accurate as torch's against float64; between a decode step's native calls
    torch's eight small ops cost 1.4 ms a routed group of 16 rows on two cores); else torch's ops."""
    if (cpu.available() and gate.shape == up.shape and gate.device.type == up.device.type == "cpu"
            and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))):
        return cpu.situ_glu(gate, up, beta, linear_beta)
    gate, up = gate.float(), up.float()
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (linear_beta * torch.tanh(up / linear_beta))


def glu_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor, act=silu_glu):
    """down(act(gate x, up x)), the dense / shared / per-expert MLP shape of most families."""
    return linear(act(linear(x, gate_w), linear(x, up_w)), down_w)


@dataclass(frozen=True)
class Situ:
    """SiTU-GLU with its two constants, as an activation the native GLU kernel can also compute."""

    beta: float = 4.0
    linear_beta: float = 25.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ_glu(gate, up, self.beta, self.linear_beta)


def native_act(act) -> tuple[str, float, float] | None:
    """(name, beta, linear_beta) of an activation the native GLU kernel computes, else None."""
    if act is silu_glu:
        return ("silu", 0.0, 0.0)
    if isinstance(act, Situ):
        return ("situ", act.beta, act.linear_beta)
    return None


# names of an expert's (gate, up, down) parts across the families (Qwen3 / Mixtral / DeepSeek / K3 bf16)
GLU_NAMES = (("gate", "up", "down"), ("w1", "w3", "w2"), ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
Glu = tuple[int, int, int, int, int, int]  # gate, up, down addresses; intermediate, input and output widths


def glu_tensors(t: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    """An expert's (gate_up, down) when fused, else its (gate, up, down); None when it has no GLU parts."""
    if "gate_up" in t:
        return t["gate_up"], t["down"]
    for names in GLU_NAMES:
        if names[0] in t:
            return tuple(t[n] for n in names)
    return None


def _bf16_matrix(m: torch.Tensor) -> bool:
    return (type(m) is torch.Tensor and m.dtype == torch.bfloat16 and m.dim() == 2 and m.is_contiguous()) \
        or type(m) is B12Weight


def _shape(m: torch.Tensor) -> tuple[int, int]:
    return (m.out_features, m.in_features) if type(m) is B12Weight else tuple(m.shape)


def _address(m: torch.Tensor) -> int:
    """What the native GLU kernels take: a bf16 matrix's address, a b12 one's tagged (_cpu_b12.c)."""
    return m.tagged_address if type(m) is B12Weight else m.data_ptr()


def glu_parts(t: Mapping[str, torch.Tensor]) -> Glu | None:
    """Addresses and widths of a bf16 GLU expert the fused native kernel takes, else None. Cached on a blob's
    PartViews (experts.store.cached_addresses)."""
    return cached_addresses(t, "glu", lambda: _glu_parts(t))


def _glu_parts(t: Mapping[str, torch.Tensor]) -> Glu | None:
    parts = glu_tensors(t)
    if parts is None or not all(_bf16_matrix(m) for m in parts):
        return None
    if len(parts) == 2:
        gu, down = parts
        inter = gu.shape[0] // 2
        # a b12 gate_up is one coded matrix: its up rows have no address of their own (the general path)
        if type(gu) is torch.Tensor and gu.shape[0] % 2 == 0 and _shape(down)[1] == inter:
            gate = gu.data_ptr()
            return gate, gate + inter * gu.shape[1] * 2, _address(down), inter, gu.shape[1], _shape(down)[0]
        return None
    gate, up, down = parts
    if _shape(gate) == _shape(up) and _shape(down)[1] == _shape(gate)[0]:
        return _address(gate), _address(up), _address(down), *_shape(gate), _shape(down)[0]
    return None


# compute scratch kept per engine (its accountant): the bf16 GLU calls' workspace (fused.glu_workspace), which lies
# within the fixed scratch the budget holds for an expert; it goes with the engine
_SCRATCH: "weakref.WeakKeyDictionary[MemoryAccountant, dict]" = weakref.WeakKeyDictionary()


def _native_glu(x: torch.Tensor, parts: list[Glu], spec: tuple[str, float, float], out: torch.Tensor,
                experts: list[int] | None = None, ids: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, counts: list[int] | None = None) -> bool:
    """One fused native call for experts of one shape; False (nothing done) when the shapes do not fit.
    `counts`: each expert's routed pairs, where the caller knows them (fused.moe_glu_bf16)."""
    first = parts[0]
    if any(p[3:] != first[3:] for p in parts) or first[4] != x.shape[1] or first[5] != out.shape[-1]:
        return False
    bf16 = (out.dim() == 2 and _bf16_rows(x.shape[0], BF16_GLU_MIN_ROWS) and first[3] % 2 == 0
            and first[4] % 2 == 0)
    memory = _COMPUTE.get()[1]
    ws = fused.glu_workspace(_SCRATCH.setdefault(memory, {}), first[3], first[4], first[5]) \
        if bf16 and memory is not None else None
    fused.moe_glu_bf16(x, experts or [0] * len(parts), [p[:3] for p in parts], first[3], out, ids, weights, *spec,
                       counts=counts, compute="bf16" if bf16 else "fp32", workspace=ws)
    return True


def _native_add(spec: tuple[str, float, float] | None, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: list[int], tensors: list[Mapping[str, torch.Tensor]], out: torch.Tensor,
                counts: list[int] | None = None) -> bool:
    """out[t] += weights[t, j] * expert(x[t]) for every (t, j) routed to one of `experts` (bf16 GLU tensors), in one
    fused native call from the stored bytes; False, with nothing done, where that kernel does not apply.
    `counts`: the pairs routed to each of `experts`, where the caller knows them. An out of [T, k, D] (the
    batch-invariant runner's per-slot outputs) receives out[t, j] = expert(x[t]) instead (fused.moe_glu_bf16)."""
    if spec is None or x.requires_grad or not cpu.available():
        return False
    parts = [glu_parts(t) for t in tensors]
    if any(p is None for p in parts):
        return False
    return _native_glu(cpu.rows(x, x.shape[-1]), parts, spec, out, experts, ids, weights, counts)


def expert_glu(act=silu_glu):
    """An expert function over a GLU expert's tensors (gate / up / down under any of GLU_NAMES, or fused gate_up,
    gate rows first). bf16 experts of a few rows take the fused native kernel (gate, up, act, down in one call)."""
    spec = native_act(act)

    def fn(x: torch.Tensor, t: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if spec is not None and not x.requires_grad and cpu.available():
            parts = glu_parts(t)
            if parts is not None:
                out = torch.zeros(x.shape[0], parts[5], dtype=torch.float32)
                if _native_glu(cpu.rows(x, x.shape[-1]), [parts], spec, out):
                    return out
        got = glu_tensors(t)
        if got is None:
            raise KeyError(f"expert has no GLU parts: {sorted(t)}")
        if len(got) == 2:
            gate, up = linear(x, got[0]).chunk(2, dim=-1)
            return linear(act(gate, up), got[1])
        return glu_mlp(x, *got, act)

    def accumulate(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert: int, rows: int,
                   t: Mapping[str, torch.Tensor], out: torch.Tensor) -> bool:
        """out[r] += weights[r, j] * fn(x[r]) for the `rows` rows r with ids[r, j] == expert, in one fused native
        call straight from the stored bf16 bytes (no row gather, no fp32 upcast, no index_add); False, with nothing
        done, where that kernel does not apply. At any row count: with the gather, upcast and index_add it
        replaces, the torch path lost even at hundreds of rows an expert (docs/performance.md)."""
        return _native_add(spec, x, ids, weights, [expert], [t], out, [rows])

    accumulate.pairs = True  # type: ignore[attr-defined]  # takes the runner's batch-invariant [T, k, D] out
    fn.accumulate = accumulate  # type: ignore[attr-defined]
    fn.act = act  # what the native decode layer's expert table computes (SoftmaxMoE.resident_table)
    return fn


def routed_spans(ids: torch.Tensor, experts: list[int]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The (row, slot) pairs of ids [T, k] routed to one of `experts`, grouped by expert (ascending id, rows in
    order within an expert): their positions in ids.reshape(-1) (row = position // k, slot = position % k), and
    per expert present (its index in `experts`, first pair, pairs). A grouped call gathers its rows in this order
    so that each expert's rows are one contiguous slice."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order].tolist()
    slot = {e: j for j, e in enumerate(experts)}
    pick: list[int] = []
    spans = []
    i, total = 0, len(sorted_ids)
    while i < total:
        e, start = sorted_ids[i], i
        while i < total and sorted_ids[i] == e:
            i += 1
        if e in slot:
            spans.append((slot[e], len(pick), i - start))
            pick.extend(range(start, i))
    return order[torch.tensor(pick, dtype=torch.long)], spans


def routed_group(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: list[int], tensors: list,
                 out: torch.Tensor, most: int, native: Callable, fn: Callable) -> None:
    """A grouped expert call's frame: the rows routed to `experts` gathered by expert (routed_spans) into xr, each
    expert's outputs computed into y at its rows' places, then out[row] += weight * y (into the batch-invariant
    runner's per-slot [T, k, D] out: out[row, slot] = y). `native(xr, y, few)` computes the experts of at most
    `most` rows, `few` their spans (index in `experts`, first row in xr / y, rows); the others go through `fn(rows,
    tensors[j])` one by one. Rows are summed in expert order, as the runner's one-by-one path adds them."""
    k = ids.shape[1]
    sel, spans = routed_spans(ids, experts)
    rows = sel // k
    xr = x.index_select(0, rows).float().contiguous()  # [R, in], grouped by expert
    y = torch.empty(sel.numel(), out.shape[-1], dtype=torch.float32)
    few = [s for s in spans if s[2] <= most]
    if few:
        native(xr, y, few)
    for j, start, count in spans:
        if count > most:
            y[start:start + count] = fn(xr[start:start + count], tensors[j])
    if out.dim() == 3:
        out[rows, sel % k] = y
    else:
        out.index_add_(0, rows, y * weights.reshape(-1)[sel].float().unsqueeze(-1))


def glu_group(act=silu_glu) -> Callable[..., bool]:
    """The runner's grouped call for bf16 GLU experts: every resident expert of a layer step (each token through
    its routed experts only) in fused native calls (one, unless the rows' scratch needs several: fused.moe_glu_bf16),
    threads splitting the rows. Declines (the runner then goes expert by expert) for other formats or activations,
    or without the native kernels."""
    spec = native_act(act)

    def run(x, ids, weights, experts, tensors, out, counts: list[int] | None = None) -> bool:
        return _native_add(spec, x, ids, weights, experts, tensors, out, counts)

    run.pairs = True  # type: ignore[attr-defined]  # takes the runner's batch-invariant [T, k, D] out
    run.counts = True  # type: ignore[attr-defined]  # takes the pairs routed to each expert (no bincount per call)
    return run


def softmax_route(x: torch.Tensor, gate: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax_topk(linear(x, gate), k, renormalize), in one native call (GEMV, softmax, top-k) for the few rows of
    a decode step with a bf16 router; the same values up to fp32 rounding. Batch-invariantly (kernels/invariant.py):
    the fixed-order product, then softmax and top-k one row at a time natively."""
    if invariant.active() and cpu.available():
        return cpu.softmax_topk(linear(x, gate, fp32=True), k, renormalize)
    if (x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and gate.is_contiguous()
            and cpu.bf16_native(gate, x) and gate.shape[1] == x.shape[1]):
        return fused.router_softmax_topk(x, gate, k, renormalize)
    return softmax_topk(linear(x, gate, fp32=True), k, renormalize)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, then top-k (Mixtral, Qwen3-MoE). Returns (ids, weights) [T, k]."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor | None, k: int, renormalize: bool, scale: float,
                 n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3-style router: sigmoid scores, biased (group-limited) selection, unbiased weights."""
    scores = torch.sigmoid(logits.float())  # [T, E]
    choice = scores + bias.float() if bias is not None else scores
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        mask = keep.unsqueeze(-1).expand_as(grouped).reshape(t, e)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    ids = torch.topk(choice, k, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale


class Router:
    """A MoE layer's router: x [T, H] -> (expert ids, weights) [T, k], each row best first.

    `select` is the ids alone, by the same computation: the lookahead runs it one layer early (on the previous MoE
    layer's router input), so a prediction names exactly the experts this router would pick for that input.
    `select(x, width)` ranks `width` times as many by the same scores (a remote checkpoint's fetch-ahead guesses
    wider than the RAM read-ahead: over a link a missed expert costs a round trip after the router asks)."""

    top_k: int

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def select(self, x: torch.Tensor, width: int = 1) -> torch.Tensor:
        """Expert ids [T, n] best first: the router's own top-k (width 1), or its top width x k by the same
        selection scores (at most every expert the selection rule can pick)."""
        if width == 1:
            return self(x)[0]
        return self.ranked(x, width * self.top_k)

    def ranked(self, x: torch.Tensor, n: int) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class SoftmaxRouter(Router):
    """Mixtral / Qwen3-MoE: softmax over all experts in fp32, top-k, optionally renormalised."""

    weight: torch.Tensor  # [E, H]
    top_k: int
    renormalize: bool

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_route(x, self.weight, self.top_k, self.renormalize)

    def ranked(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return softmax_route(x, self.weight, min(n, self.weight.shape[0]), self.renormalize)[0]


@dataclass(frozen=True, eq=False)
class SigmoidRouter(Router):
    """DeepSeek-V3 / Kimi K2 / Kimi Linear / Kimi K3: sigmoid scores; the correction bias and the group limit
    (top `topk_group` of `n_group` groups, each scored by its best two) only select, the unbiased scores weigh."""

    weight: torch.Tensor  # [E, H]
    bias: torch.Tensor | None  # e_score_correction_bias [E]
    top_k: int
    renormalize: bool
    scale: float
    n_group: int = 1
    topk_group: int = 1

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sigmoid_topk(linear(x, self.weight, fp32=True), self.bias, self.top_k, self.renormalize, self.scale,
                            self.n_group, self.topk_group)

    def ranked(self, x: torch.Tensor, n: int) -> torch.Tensor:
        # the group limit leaves topk_group groups' experts selectable
        n = min(n, self.weight.shape[0] * min(self.topk_group, self.n_group) // max(1, self.n_group))
        return sigmoid_topk(linear(x, self.weight, fp32=True), self.bias, n, self.renormalize, self.scale,
                            self.n_group, self.topk_group)[0]


@dataclass(frozen=True, eq=False)
class BiasedRouter(Router):
    """gpt-oss: top-k of the biased logits, softmax over those k."""

    weight: torch.Tensor  # [E, H]
    bias: torch.Tensor  # [E]
    top_k: int

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(linear(x, self.weight, self.bias, fp32=True), self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=-1)

    def ranked(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return torch.topk(linear(x, self.weight, self.bias, fp32=True), min(n, self.weight.shape[0]),
                          dim=-1).indices


def embed(tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, tokens).float()
