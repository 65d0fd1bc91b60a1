"""Kimi K3's latent MoE: sigmoid router on the full width, routed experts in a narrower latent space.

Owns the routing rule (the correction bias selects, the unbiased scores weigh), the latent down-projection,
the SiTU expert computed straight from MXFP4 (or bf16) bytes, the latent norm, the up-projection and the
shared experts on the full width. Expert bytes come through the ExpertRunner; no expanded copy is cached.
"""
from __future__ import annotations

from typing import Callable

import torch

from moestream.errors import CheckpointError
from moestream.experts.store import cached_addresses
from moestream.kernels import cpu
from moestream.kernels.qweight import matrix_shape
from moestream.kernels.quant import (GROUP_DECODE_BYTES, bf16_rounded, check_mxfp4_scales, mxfp4_decode_planes,
                                     mxfp4_linear, mxfp4_permute_input)
from moestream.models.base import routed, router
from moestream.models.blocks import (SigmoidRouter, Situ, expert_glu, glu_group, glu_mlp, linear, mxfp4_bf16,
                                     rms_norm, routed_group, routed_spans)

Act = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_act(beta: float, linear_beta: float) -> Act:
    return Situ(beta, linear_beta)


def latent_norm(y: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(y, w, eps)


def mxfp4_expert(act: Act) -> Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]:
    """One expert on latent rows z [n, latent]: w2 act(w1 z, w3 z), decoding the packed bytes per call."""

    def fn(z: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
        bf16 = mxfp4_bf16()
        gate = mxfp4_linear(z, t["w1_packed"], t["w1_scale"], bf16=bf16)  # [n, I]
        up = mxfp4_linear(z, t["w3_packed"], t["w3_scale"], bf16=bf16)
        return mxfp4_linear(act(gate, up), t["w2_packed"], t["w2_scale"], bf16=bf16)  # [n, latent]

    return fn


DENSE_GROUP_MAX_ROWS = 16  # up to this many rows (decode batches), every row goes through every grouped expert


def _all_rows(zp, ids, weights, experts, w13, w2, act, out, rnd) -> None:
    """Decode-sized steps: all rows through all of the group's experts in a few batched ops (a handful of kernel
    calls instead of several per expert), then each row keeps its routed experts' outputs by weight (0 else).
    SiTU is bounded, so unrouted products are finite and their zero weight removes them exactly. `rnd` rounds
    the products' activations (the bf16 compute path) or returns them."""
    t, n = zp.shape[0], len(experts)
    inter = w13.shape[2]
    g = (zp @ w13.view(n * 2 * inter, -1).T).view(t, n, 2, inter)
    h = rnd(act(g[:, :, 0], g[:, :, 1]))  # [T, n, inter]
    hp = mxfp4_permute_input(h.reshape(t * n, inter)).view(t, n, inter).transpose(0, 1)  # [n, T, inter]
    y = torch.bmm(hp, w2.transpose(1, 2))  # [n, T, latent]
    match = ids.unsqueeze(-1) == torch.tensor(experts).view(1, 1, n)  # [T, k, n]
    mix = (weights.float().unsqueeze(-1) * match).sum(1)  # [T, n]
    out += torch.einsum("tn,ntl->tl", mix, y)


def _native_group(z, ids, weights, experts, tensors, act, out, bf16: bool = False) -> None:
    """Each row through its routed experts only, all of the group's experts in two native calls (w1 and w3 of
    every expert, then w2 of every expert) straight from the packed bytes, in blocks.routed_group's frame (rows
    gathered by expert, each expert's rows one contiguous slice). For steps of at most NATIVE_GROUP_MAX_ROWS rows; a
    decode step's one row of SiTU experts in fp32 compute takes one call instead (_one_token_situ, the same bits)."""
    inter, latent = _group_dims(z, tensors)
    if z.shape[0] == 1 and not bf16 and isinstance(act, Situ) and _one_token_situ(z, ids, weights, experts, tensors,
                                                                                 act, out, inter, latent):
        return

    def native(zr: torch.Tensor, y: torch.Tensor, few: list[tuple[int, int, int]]) -> None:
        gate_up = torch.empty(2, zr.shape[0], inter, dtype=torch.float32)
        zp, gp, up, yp = zr.data_ptr(), gate_up[0].data_ptr(), gate_up[1].data_ptr(), y.data_ptr()
        xs, ts, ps, ss, outs, who = [], [], [], [], [], []
        ps2, ss2, outs2, who2 = [], [], [], []
        keep = []  # contiguous copies made here must outlive the calls
        for j, start, count in few:
            w1p, w1s, w3p, w3s, w2p, w2s = _pointers(tensors[j], keep, inter, latent)
            x = zp + start * latent * 4
            xs += (x, x)
            ts += (count, count)
            ps += (w1p, w3p)
            ss += (w1s, w3s)
            outs += (gp + start * inter * 4, up + start * inter * 4)
            who += ((j, "w1_scale"), (j, "w3_scale"))
            ps2.append(w2p)
            ss2.append(w2s)
            outs2.append(yp + start * latent * 4)
            who2.append((j, "w2_scale"))
        bad = cpu.linear_mxfp4_ptrs(xs, ts, ps, ss, outs, inter, latent, bf16=bf16)
        if bad >= 0:
            check_mxfp4_scales(tensors[who[bad][0]][who[bad][1]])  # raises the 0xFF scale error
        h = act(gate_up[0], gate_up[1]).float().contiguous()  # [R, inter]
        hp = h.data_ptr()
        xs2 = [hp + start * inter * 4 for _, start, _ in few]
        bad = cpu.linear_mxfp4_ptrs(xs2, ts[::2], ps2, ss2, outs2, latent, inter, bf16=bf16)
        if bad >= 0:
            check_mxfp4_scales(tensors[who2[bad][0]][who2[bad][1]])

    # every expert of such a step has at most NATIVE_GROUP_MAX_ROWS rows: all of them go to `native`
    routed_group(z, ids, weights, experts, tensors, out, NATIVE_GROUP_MAX_ROWS, native, mxfp4_expert(act))


_PARTS = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")


def _one_token_situ(z, ids, weights, experts, tensors, act: Situ, out, inter: int, latent: int) -> bool:
    """A decode step's one row through its routed SiTU experts in one native call (cpu.mxfp4_situ_group1): the
    bits routed_group and `native` above give (experts in ascending id, each term y * w added in that order), less
    their gather, three calls and the torch ops between them (its pairs in routed_spans' order). False (nothing
    done) where the frame differs: the batch-invariant runner's per-slot out, an out or weights that are not
    float32, an expert routed twice in the row."""
    if out.dim() != 2 or out.dtype != torch.float32 or not out.is_contiguous() or weights.dtype != torch.float32:
        return False
    sel, spans = routed_spans(ids, experts)  # the frame's order: ascending expert id
    if any(count != 1 for _, _, count in spans):
        return False
    if not spans:
        return True
    keep: list = []
    w13, w2, order = [], [], []
    for j, _, _ in spans:
        w1p, w1s, w3p, w3s, w2p, w2s = _pointers(tensors[j], keep, inter, latent)
        w13 += ((w1p, w1s), (w3p, w3s))
        w2.append((w2p, w2s))
        order.append(j)
    wts = weights.reshape(-1)[sel].contiguous()
    x = z.float().contiguous()
    scratch = torch.empty(len(spans) * (2 * inter + latent), dtype=torch.float32)  # gate, up and y, as before
    bad = cpu.mxfp4_situ_group1(x.data_ptr(), w13, w2, wts.data_ptr(), inter, latent, act.beta, act.linear_beta,
                                scratch.data_ptr(), out.data_ptr())
    if bad >= 0:
        n = len(spans)
        j, name = (order[bad // 2], "w1_scale" if bad % 2 == 0 else "w3_scale") if bad < 2 * n \
            else (order[bad - 2 * n], "w2_scale")
        check_mxfp4_scales(tensors[j][name])  # raises the 0xFF scale error
    return True


def _group_dims(z: torch.Tensor, tensors) -> tuple[int, int]:
    """(inter, latent) of a group of MXFP4 experts, after checking that every expert's six parts have the shapes
    those imply and that z's rows are `latent` wide: the native call reads every expert with one shape, so a
    malformed expert would otherwise be read out of bounds. A blob's check is cached with its addresses."""
    inter, latent = tensors[0]["w1_packed"].shape[0], z.shape[1]
    for t in tensors:
        _checked(t, inter, latent)
    return inter, latent


def _checked(t, inter: int, latent: int) -> tuple[int, ...] | None:
    """Addresses of an expert's six parts (None where one is not contiguous) once their shapes and dtype are those
    of (inter, latent), else CheckpointError; cached on a blob's PartViews (experts.store.cached_addresses) for
    that shape, so a cached expert is checked once, not every step."""
    def make() -> tuple[int, ...] | None:
        want = {"w1_packed": (inter, latent // 2), "w3_packed": (inter, latent // 2),
                "w2_packed": (latent, inter // 2), "w1_scale": (inter, latent // 32),
                "w3_scale": (inter, latent // 32), "w2_scale": (latent, inter // 32)}
        for name, shape in want.items():
            got = t[name]
            if tuple(got.shape) != shape or got.dtype != torch.uint8 or latent % 32 or inter % 32:
                raise CheckpointError(f"MXFP4 expert part {name} has {got.dtype}{list(got.shape)}, expected "
                                      f"uint8{list(shape)} (latent width {latent}, expert width {inter})")
        return tuple(t[n].data_ptr() for n in _PARTS) if all(t[n].is_contiguous() for n in _PARTS) else None

    return cached_addresses(t, ("mxfp4", inter, latent), make)


def _pointers(t, keep: list, inter: int, latent: int) -> tuple[int, ...]:
    """Addresses of an expert's six parts, checked (_checked); other mappings' non-contiguous parts are copied into
    `keep`."""
    got = _checked(t, inter, latent)
    if got is not None:
        return got
    parts = [t[n].contiguous() for n in _PARTS]
    keep.extend(parts)
    return tuple(p.data_ptr() for p in parts)


NATIVE_GROUP_MAX_ROWS = 64  # up to this many rows per step the grouped experts use the native kernels (if available)


def mxfp4_group(act: Act):
    """Several resident MXFP4 experts in one go. With the native kernels (small steps): each row through its routed
    experts, two native calls for the whole group. Otherwise their packed w1/w3 and w2 are decoded together (in
    groups that fit GROUP_DECODE_BYTES), then each expert's rows multiply its slice. Declines experts too big for
    the scratch."""

    def run(z, ids, weights, experts, tensors, out) -> bool:
        bf16 = mxfp4_bf16()
        if z.shape[0] <= NATIVE_GROUP_MAX_ROWS and cpu.available():
            _native_group(z, ids, weights, experts, tensors, act, out, bf16)
            return True
        inter, latent = _group_dims(z, tensors)
        per = 3 * inter * latent * 4
        if per > GROUP_DECODE_BYTES:
            return False
        size = GROUP_DECODE_BYTES // per
        rnd = bf16_rounded if bf16 else (lambda v: v)
        zp = mxfp4_permute_input(rnd(z))
        for c in range(0, len(experts), size):
            ts, es = tensors[c:c + size], experts[c:c + size]
            # columns come out in the kernel's half-plane order, so inputs are permuted to match
            w13 = mxfp4_decode_planes(torch.cat([t[k] for t in ts for k in ("w1_packed", "w3_packed")]),
                                      torch.cat([t[k] for t in ts for k in ("w1_scale", "w3_scale")]))
            w2 = mxfp4_decode_planes(torch.cat([t["w2_packed"] for t in ts]), torch.cat([t["w2_scale"] for t in ts]))
            w13, w2 = w13.view(len(ts), 2, inter, latent), w2.view(len(ts), latent, inter)
            if z.shape[0] <= DENSE_GROUP_MAX_ROWS:
                _all_rows(zp, ids, weights, es, w13, w2, act, out, rnd)
                continue
            for j, e in enumerate(es):
                rows, slots = torch.nonzero(ids == e, as_tuple=True)
                zr = zp[rows]  # [n, latent], permuted
                h = act(zr @ w13[j, 0].T, zr @ w13[j, 1].T)  # [n, inter]
                y = mxfp4_permute_input(rnd(h)) @ w2[j].T  # [n, latent]
                out.index_add_(0, rows, y * weights[rows, slots].unsqueeze(-1).float())
        return True

    return run


class LatentMoE:
    """The feed-forward of one MoE layer (spec 2.4): x [T, H] -> [T, H] fp32."""

    def __init__(self, ctx, layer: int, top_k: int, scale: float, use_norm: bool, eps: float, act: Act,
                 quantized: bool):
        w, p = ctx.weights, f"model.layers.{layer}.block_sparse_moe"
        self.runner, self.layer, self.eps = ctx.experts, layer, eps
        # top-k of sigmoid(logits) + bias on the full width; weights: the unbiased scores, renormalised, times scale
        self.route = routed(ctx, layer, SigmoidRouter(router(ctx, f"{p}.gate.weight"),
                                                      w.get(f"{p}.gate.e_score_correction_bias"), top_k, True, scale))
        self.down, self.up = w.get(f"{p}.routed_expert_down_proj.weight"), w.get(f"{p}.routed_expert_up_proj.weight")
        self.norm = w.get(f"{p}.routed_expert_norm.weight") if use_norm else None
        names = [f"{p}.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")]
        self.shared = [w.get(n) for n in names] if names[0] in w else None
        self.act = act
        self.fn = mxfp4_expert(act) if quantized else expert_glu(act)  # bf16 experts: w1 / w3 / w2
        self.group = mxfp4_group(act) if quantized else glu_group(act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)  # [T, k] each
        z = linear(x, self.down)  # [T, latent]
        # the experts see z; the lookahead runs the next layer's full-width router on x
        y = self.runner.run(self.layer, z, ids, weights, self.fn, out_dim=matrix_shape(self.down)[0],
                            group=self.group, router_input=x)  # [T, latent]
        if self.norm is not None:
            y = latent_norm(y, self.norm, self.eps)
        y = linear(y, self.up)  # [T, H]
        if self.shared is not None:
            y = y + glu_mlp(x, *self.shared, act=self.act)
        return y
