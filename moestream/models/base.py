"""What every family shares: the family descriptor, dense-weight loading, and the pre-norm decoder skeleton.

Owns `Family` (how the registry and engine see a model type), `ExpertLayout` (where a family's routed experts
live), `DenseWeights` (budget-accounted loading of non-expert tensors by Hugging Face name) and `DecoderModel`
(embed -> layers -> norm -> head over a flat multi-sequence batch). Families subclass or compose these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moestream.memory.accountant import MemoryAccountant
from moestream.memory.state import BLOCK_TOKENS, Batch, SeqState
from moestream.errors import CheckpointError
from moestream.experts.dispatch import ExpertRunner
from moestream.experts.store import PartSpec
from moestream.kernels import cpu, fused, invariant
from moestream.kernels.b12 import B12Weight
from moestream.kernels.qweight import matrix_shape
from moestream.models.blocks import (Router, SigmoidRouter, SoftmaxRouter, embed, expert_glu, glu_group, glu_mlp,
                                     glu_parts, linear, native_act, native_glu_fp32, rms_norm, silu_glu)
from moestream.weights.index import CheckpointIndex


@dataclass
class ExpertLayout:
    parts: list[PartSpec]
    num_experts: int
    top_k: int
    moe_layers: list[int]


@dataclass
class Family:
    """A model type: parse its config, say where experts are, build the model."""

    model_type: str
    parse: Callable[[dict], Any]  # HF config dict -> family config dataclass
    experts: Callable[[Any, set[str]], ExpertLayout]  # (config, tensor names without prefix)
    build: Callable[[Any, "ModelContext"], "DecoderModel"]
    prefix: str = ""  # tensor-name prefix of the language model (K3: "language_model.")
    ignore: tuple[str, ...] = ()  # tensor-name prefixes never read (vision tower)
    # config -> every tensor name (with prefix) -> (shape, safetensors dtype); lets `info` size a directory that
    # holds only config.json
    inventory: Callable[[Any], dict[str, tuple[tuple[int, ...], str]]] | None = None

    def wants(self, name: str) -> bool:
        return name.startswith(self.prefix) and not name.startswith(self.ignore)


class DenseWeights:
    """Loads non-expert tensors by HF name (prefix added), counting their bytes against the budget.

    A tensor the residency plan streams is not loaded: the engine's DenseStreamer (`memory.streamer`) hands out a
    placeholder whose storage it fills before that tensor's layer runs and empties after."""

    def __init__(self, index: CheckpointIndex, prefix: str, memory: MemoryAccountant):
        self.index = index
        self.prefix = prefix
        self.memory = memory
        self.loaded: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.index

    def get(self, name: str) -> torch.Tensor:
        if name not in self.loaded:
            streamer = self.memory.streamer
            if streamer is not None and streamer.streams(name):
                self.loaded[name] = streamer.tensor(name)
                return self.loaded[name]
            t = self.index.load(self.prefix + name)
            self.memory.add_dense(t.numel() * t.element_size())
            self.loaded[name] = t
        return self.loaded[name]

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None


@dataclass
class ModelContext:
    weights: DenseWeights
    experts: ExpertRunner
    memory: MemoryAccountant


def residual(h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """h + a, written into `a` where it is a block's own fresh output (fp32, h's shape, contiguous over all of its
    storage, no grad): the same values (an fp32 sum does not depend on the operands' order) without a new [T, H]
    temporary, whose pages a large step faults in afresh under a scheduler's fixed mmap threshold
    (engine/allocator.py)."""
    if (a.dtype == h.dtype == torch.float32 and a.shape == h.shape and a.is_contiguous() and a.storage_offset() == 0
            and a.untyped_storage().nbytes() == 4 * a.numel() and not (a.requires_grad or h.requires_grad)
            and a.data_ptr() != h.data_ptr()):
        return a.add_(h)
    return h + a


@dataclass
class Layer:
    """One pre-norm decoder layer: h += mixer(norm(h)); h += ffn(norm(h))."""

    mixer: Callable[[torch.Tensor, Batch, int], torch.Tensor]
    ffn: Callable[[torch.Tensor], torch.Tensor]
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float

    def __call__(self, h: torch.Tensor, batch: Batch, index: int) -> torch.Tensor:
        if h.shape[0] == 1 and not invariant.active() and (fast := self._decode(h, batch, index)) is not None:
            return fast
        if h.shape[0] > 1 and not invariant.active() and (fast := self._rows(h, batch, index)) is not None:
            return fast
        x = rms_norm(h, self.in_norm, self.eps)
        h = residual(h, self.mixer(x, batch, index))
        # the mixer is done with its input: the post-norm goes into that buffer (no second fresh [T, H] a layer)
        return residual(h, self.ffn(rms_norm(h, self.post_norm, self.eps,
                                             out=x if x.data_ptr() != h.data_ptr() else None)))

    def _rows(self, h: torch.Tensor, batch: Batch, index: int) -> torch.Tensor | None:
        """A short prompt chunk of one sequence: the mixer's attention half and the router in one native call when
        the mixer has one (GQAMixer.rows_block), in the same call the routed experts when the runner's table holds
        all of them (and its grouped call would be one native call: ExpertTable.one_call; the runner then keeps
        the books, `rows_done`), else the routed experts through the runner as usual: the same values as the
        general path with a fraction of its Python. None when it does not apply."""
        block = getattr(self.mixer, "rows_block", None)
        if block is None or not self.mixer.rows_fit(h, batch):  # (no expert table made for a step that cannot)
            return None
        return self._one_call(h, batch, index, block, rows=True)

    def _decode(self, h: torch.Tensor, batch: Batch, index: int) -> torch.Tensor | None:
        """One decode token: the mixer's attention half and the router in one native call when the mixer has one
        (GQAMixer.decode_block), and in the same call the routed experts when the runner holds all of them
        (the MoE's resident table), else the routed experts from that routing (one grouped call when resident):
        the same values as the two lines above with a fraction of their Python. None when it does not apply."""
        block = getattr(self.mixer, "decode_block", None)
        return None if block is None else self._one_call(h, batch, index, block, rows=False)

    def _one_call(self, h: torch.Tensor, batch: Batch, index: int, block, rows: bool) -> torch.Tensor | None:
        """`block` (the mixer's decode_block, or its rows_block when `rows`) with the MoE's router and resident
        table (for rows, only where the runner's grouped call would be one native call), then the runner's books
        (resident_done / rows_done) when the experts ran in the call, else the experts through the runner."""
        moe = self.ffn if isinstance(self.ffn, SoftmaxMoE) else None
        table = moe.resident_table() if moe is not None else None
        if rows and table is not None and not (native_glu_fp32(h.shape[0])
                                               and table.one_call(h.shape[0], moe.router.top_k)):
            table = None
        got = block(h, batch, index, self.in_norm, self.post_norm, self.eps, moe.router if moe else None, table)
        if got is None:
            return None
        h, x, ids, weights, done = got
        if done:
            table.used += 1
            uniq = sorted(set(ids.view(-1).tolist()))
            if rows:
                moe.ctx.experts.rows_done(moe.layer, uniq, x, ids.shape[1])
            else:
                moe.ctx.experts.resident_done(moe.layer, uniq, x)
            return h
        return residual(h, moe.experts(x, ids, weights) if moe is not None and ids is not None else self.ffn(x))


@dataclass
class DecoderModel:
    embed_tokens: torch.Tensor
    layers: list[Any]
    norm: torch.Tensor
    lm_head: torch.Tensor
    eps: float
    vocab_size: int
    memory: MemoryAccountant
    extra: dict = field(default_factory=dict)
    after_layer: Callable[[], None] | None = None  # run by leave_layer after each layer of a step (the engine sets it)
    # decode_layers' plan: None until built at a warm step, False where the layers do not fit it
    _all_layers: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        """The ends of the model must agree with config.json: token ids below vocab_size index the embedding, and
        the final norm, embedding and head share the hidden width."""
        e, n = self.embed_tokens, self.norm
        h = matrix_shape(self.lm_head)
        if e.dim() != 2 or len(h) != 2 or n.dim() != 1 or e.shape[0] < self.vocab_size \
                or h[0] < self.vocab_size or not e.shape[1] == h[1] == n.shape[0]:
            raise CheckpointError(f"embedding {list(e.shape)}, final norm {list(n.shape)} and lm_head {list(h)} "
                                  f"do not fit config.json's vocab_size {self.vocab_size} and one hidden width")
        self._head_after = self._link_prefetch()

    def _link_prefetch(self) -> tuple[list[torch.Tensor], Any] | None:
        """Each layer's one-call decode (GQAMixer.decode_block) has the pool's workers read the next layer's dense
        weights (the last layer: the lm_head's) ahead while Python runs between the calls, and the lm_head call
        layer 0's. Returns the regions to read after the lm_head (None when layer 0 has no such weights)."""
        def first(layer) -> list[torch.Tensor]:
            mixer = getattr(layer, "mixer", None)
            got = mixer.decode_weights() if hasattr(mixer, "decode_weights") else []
            ffn = getattr(layer, "ffn", None)
            if got and isinstance(ffn, SoftmaxMoE) and type(ffn.router.weight) is torch.Tensor:
                got.append(ffn.router.weight)
            return got
        for i, layer in enumerate(self.layers):
            if hasattr(getattr(layer, "mixer", None), "prefetch_next"):
                last = [self.lm_head] if type(self.lm_head) in (torch.Tensor, B12Weight) else []
                layer.mixer.prefetch_next = first(self.layers[i + 1]) if i + 1 < len(self.layers) else last
        head = first(self.layers[0]) if self.layers else []
        return (head, fused.prefetch_regions(head)) if head else None

    @property
    def residency(self):
        """The engine's DenseStreamer when some dense weights stream (the accountant holds it), else None."""
        return self.memory.streamer

    def new_state(self) -> SeqState:
        return SeqState(self.memory, len(self.layers))

    def hidden(self, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        h = self.embed(tokens)  # [T, H]
        if tokens.shape[0] == 1 and self.residency is None and (done := self.decode_layers(h, batch)) is not None:
            return done
        for i, layer in enumerate(self.layers):
            self.enter_layer(i)
            h = layer(h, batch, i)
            self.leave_layer(i)
        return h

    def decode_layers(self, h: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """A warm decode token through every layer by native calls (fused.DecodeLayers: each layer what
        Layer._decode's one call computes, h carried from layer to layer in C), when every layer is GQA attention and
        a SoftmaxMoE whose one-call decode fits and the runner's tables may be used (`_layers_plan`). The layers
        run in stretches: a stretch ends after a layer whose bookkeeping may read experts (`ExpertRunner.reads_after`:
        read-ahead in flight, or the lookahead reading the next layer's), so that reads start where the layer-by-layer
        path starts them, and where a layer routes to an expert its table lacks (its experts then go through the
        runner, as Layer._decode sends them). Each layer's bookkeeping is the runner's (`resident_run`), in layer
        order; `after_layer` runs once after each stretch (nothing between a stretch's layers allocates). Returns
        h after the last layer, or None with nothing done (the caller runs the layers one by one)."""
        plan = self._layers_plan()
        if plan is None or invariant.active():
            return None
        mixers, moes, native = plan
        runner = moes[0].ctx.experts
        if not runner.warm() or "run" in vars(runner) or not mixers[0].decode_fits(h, batch):
            return None
        seg = batch.segments[0]
        slots = [m.slot(seg, i) for i, m in enumerate(mixers)]
        if any(s.k.block != BLOCK_TOKENS for s in slots):
            return None
        for i, s in enumerate(slots):  # each layer's new row, charged here and written by the kernel
            s.k.reserve(1)
            s.v.reserve(1)
            native.set_cache(i, s.k, s.v)
        h = h.clone(memory_format=torch.contiguous_format)
        n, i = len(mixers), 0
        while i < n:
            end = i
            while end + 1 < n and not runner.reads_after(moes[end].layer):
                end += 1
            done = native(h, i, end + 1)
            for j in range(i, done):
                mixers[j].decode_blocks += 1
                native.tables[j].used += 1
            if done > i:
                runner.resident_run([m.layer for m in moes[i:done]], native.ids[i:done].tolist(), native.x2[i:done])
            if done <= end:  # layer `done` routed to an expert not in its table: its experts through the runner
                mixers[done].decode_blocks += 1
                sl = slice(done, done + 1)
                h.add_(moes[done].experts(native.x2[sl].clone(), native.ids[sl].clone(), native.wts[sl].clone()))
                done += 1
            if self.after_layer is not None:
                self.after_layer()
            i = done
        return h

    def _layers_plan(self) -> "tuple[list, list, fused.DecodeLayers] | None":
        """(mixers, MoE layers, fused.DecodeLayers) when every layer is a `Layer` of a GQA mixer with a one-call
        decode (attention.GQAMixer.decode_block, or a wrapper of one naming it `__wrapped__`) and a SoftmaxMoE whose
        router fits it and whose experts have a native table; built at the first step the runner's tables may be
        used and kept (False where the layers do not fit). None when there is no plan."""
        plan = self._all_layers
        if plan is not None:
            return plan or None
        mixers, moes = [], []
        for layer in self.layers:
            mixer = getattr(layer, "mixer", None)
            mixer = getattr(mixer, "__wrapped__", mixer)
            if (not isinstance(layer, Layer) or not isinstance(layer.ffn, SoftmaxMoE)
                    or not hasattr(mixer, "_decode_plan") or not hasattr(mixer, "decode_fits")):
                self._all_layers = False
                return None
            mixers.append(mixer)
            moes.append(layer.ffn)
        if not moes or not cpu.available():
            return None
        runner = moes[0].ctx.experts
        if not runner.warm() or "run" in vars(runner):
            return None  # not yet (the tables are made at warm steps), or every step is watched (trace.Recorder)
        blocks, tables = [], []
        for layer, mixer, moe in zip(self.layers, mixers, moes):
            blocks.append(mixer._decode_plan(layer.in_norm, layer.post_norm, layer.eps, moe.router))
            tables.append(moe.resident_table())
        try:
            if any(b is None for b in blocks) or any(t is None for t in tables):
                raise ValueError("a layer without a one-call decode or an expert table")
            self._all_layers = (mixers, moes, fused.DecodeLayers(blocks, tables))
        except ValueError:
            self._all_layers = False
        return self._all_layers or None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 [T, H] rows of the embedding table (read from disk when the table is not resident)."""
        if self.residency is not None and self.residency.plan.embed_streamed:
            return self.residency.embed(tokens)
        return embed(tokens, self.embed_tokens)

    def enter_layer(self, i: int) -> None:
        """Called by every decoder loop before layer i: a streamed layer's weights are read in (next one ahead)."""
        if self.residency is not None:
            self.residency.enter(i)

    def leave_layer(self, i: int) -> None:
        """Called after layer i: a streamed layer's weights are given back, and `after_layer` runs when the engine
        set one for the step (engine.py `_after_layer`: the heap trimmed between the layers of a large step off the
        step heap; under a scheduler, the RSS beyond the books measured)."""
        if self.residency is not None:
            self.residency.leave(i)
        if self.after_layer is not None:
            self.after_layer()

    def head(self, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, self.norm, self.eps)
        if self.residency is not None and self.residency.plan.head_streamed:
            return self.residency.head(x)
        logits = linear(x, self.lm_head)
        if h.shape[0] == 1 and self._head_after is not None and self.residency is None:
            fused.prefetch(self._head_after[1])  # layer 0's weights, while the engine samples and embeds
        return logits

    @property
    def head_resident(self) -> bool:
        """Whether the lm_head is in RAM (not read slab by slab each step), so `head_rows` may run chunk by chunk."""
        return self.residency is None or not self.residency.plan.head_streamed

    def head_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] of final-normed rows (`forward(..., head=False)`); a resident head only."""
        return linear(x, self.lm_head)

    def forward(self, tokens: torch.Tensor, batch: Batch, rows: torch.Tensor, head: bool = True) -> torch.Tensor:
        """Logits [len(rows), V] for the requested rows of the flat batch; with `head` False their final-normed
        hidden rows [len(rows), H] instead, for `head_rows`."""
        h = self.hidden(tokens, batch).index_select(0, rows)
        return self.head(h) if head else rms_norm(h, self.norm, self.eps)


def standard_model(ctx: ModelContext, layers: list[Any], eps: float, vocab_size: int,
                   tie: bool = False) -> DecoderModel:
    w = ctx.weights
    table = w.get("model.embed_tokens.weight")
    head = table if tie or "lm_head.weight" not in w else w.get("lm_head.weight")
    return DecoderModel(table, layers, w.get("model.norm.weight"), head, eps, vocab_size, ctx.memory)


def dense_glu(w: DenseWeights, p: str, act=silu_glu) -> Callable[[torch.Tensor], torch.Tensor]:
    """The dense (or shared-expert) GLU MLP whose tensors are `{p}.{gate,up,down}_proj.weight`."""
    g, u, d = (w.get(f"{p}.{n}_proj.weight") for n in ("gate", "up", "down"))
    return lambda x: glu_mlp(x, g, u, d, act)


def router(ctx: ModelContext, name: str) -> torch.Tensor:
    """A router weight [num_experts, H]: one row per expert of the layout, so a routed id always names an expert
    (an id past the layout's count would index past a fused expert tensor)."""
    gate, n = ctx.weights.get(name), ctx.experts.store.num_experts
    if gate.dim() != 2 or gate.shape[0] != n:
        raise CheckpointError(f"{name} has shape {list(gate.shape)}: config.json says {n} experts, one row each")
    return gate


def routed(ctx: ModelContext, layer: int, r: Router) -> Router:
    """Every family's MoE layer registers its router here: the runner's lookahead then runs `r.select` (this
    layer's exact selection rule) on the previous MoE layer's router input and reads the predicted experts ahead."""
    ctx.experts.register_router(layer, r.select)
    return r


def sigmoid_moe(ctx: ModelContext, layer: int, p: str, fn, top_k: int, renormalize: bool, scale: float,
                n_group: int = 1, topk_group: int = 1, shared=None,
                group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """DeepSeek-V3 / Kimi Linear MoE at `p`: sigmoid router (the correction bias only selects), routed experts
    through the runner (`group`: its grouped call, glu_group's for bf16 SiLU-GLU experts by default), plus the
    shared MLP on the full-width input when there is one."""
    route = routed(ctx, layer, SigmoidRouter(router(ctx, f"{p}.gate.weight"),
                                             ctx.weights.maybe(f"{p}.gate.e_score_correction_bias"), top_k,
                                             renormalize, scale, n_group, topk_group))
    group = group or glu_group()  # glu_group declines other stored forms, which then go one by one

    def ffn(x: torch.Tensor) -> torch.Tensor:
        ids, wts = route(x)
        y = ctx.experts.run(layer, x, ids, wts, fn, group=group)
        return y + shared(x) if shared is not None else y

    return ffn


@dataclass(eq=False)
class SoftmaxMoE:
    """Mixtral / Qwen3-MoE MoE layer: softmax router over all experts in fp32, top-k, SiLU-GLU experts through the
    runner. `experts` runs the routed experts for a routing computed elsewhere (the native decode block's)."""

    ctx: ModelContext
    layer: int
    router: SoftmaxRouter
    fn: Callable = field(default_factory=expert_glu)
    group: Callable = field(default_factory=glu_group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, wts = self.router(x)
        return self.experts(x, ids, wts)

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.ctx.experts.run(self.layer, x, ids, weights, self.fn, group=self.group)

    def resident_table(self) -> "fused.ExpertTable | None":
        """The runner's table of this layer's resident experts for the native decode layer, while a warm step may
        use it (None otherwise: the runner has reads in flight or no step done yet, or the experts' activation
        has no native kernel)."""
        runner = self.ctx.experts
        # a wrapper of `run` on the instance (trace.Recorder logs every step's routing there) must keep seeing
        # every step, so the experts then stay out of the native call
        if not runner.warm() or "run" in vars(runner):
            return None
        table = runner.tables.get(self.layer)
        if table is None and self.layer not in runner.tables:
            table = runner.tables[self.layer] = self._new_table(runner.store.num_experts)
        return table

    def _new_table(self, experts: int) -> "fused.ExpertTable | None":
        spec = native_act(getattr(self.fn, "act", None))
        if spec is None or not cpu.available():
            return None
        return fused.ExpertTable(experts, self.router.weight.shape[1], *spec, glu_parts)


def softmax_moe(ctx: ModelContext, layer: int, p: str, top_k: int, renormalize: bool) -> SoftmaxMoE:
    """The SoftmaxMoE at `p` (its router registered for the lookahead)."""
    return SoftmaxMoE(ctx, layer, routed(ctx, layer, SoftmaxRouter(router(ctx, f"{p}.gate.weight"), top_k,
                                                                    renormalize)))
