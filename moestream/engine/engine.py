"""The engine: opens a checkpoint under a RAM budget and runs steps over several sequences at once.

Owns the open sequence (config -> family -> index -> residency plan under the budget -> dense load, streamed
layers as placeholders), `step()` (one forward over a flat batch of sequences, each with its own state), and the
single generation loop (`stream`) that the CLI, the server and batch mode share. Model math lives in models/,
expert residency in experts/, dense residency in engine/residency.py.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from moestream.config import EngineOptions, format_bytes, parse_bytes, read_model_config
from moestream.engine.allocator import HeapTrim, ResidentCheck, StepHeap, StepRoom, anon_rss, return_freed_memory
from moestream.memory.accountant import MemoryAccountant
from moestream.engine.residency import DenseStreamer, ResidencyPlan, plan_residency
from moestream.engine.sampling import SamplingParams, sample
from moestream.memory.state import Batch, SeqState, beyond_allowance, kv_dtype, transient
from moestream.errors import BudgetError, CheckpointError, MoestreamError, RequestError
from moestream.experts.dispatch import ExpertRunner
from moestream.experts.reader import IO_THREADS
from moestream.experts.store import ExpertStore, fp32_nbytes
from moestream.kernels import cpu, invariant
from moestream.kernels.fused import b12_scratch
from moestream.kernels.qweight import dense_scratch_bytes
from moestream.kernels.quant import GROUP_DECODE_BYTES, SCRATCH_BYTES as QUANT_SCRATCH_BYTES
from moestream.models.blocks import UPCAST_CHUNK_BYTES, check_compute_dtype, compute_dtype
from moestream.models.base import DenseWeights, ExpertLayout, ModelContext
from moestream.models.hfconfig import parse_config
from moestream.models.kda import KDAOptions, chunk_plan
from moestream.models.registry import family_for
from moestream.weights.index import CheckpointIndex
from moestream.weights.remote import model_path


@dataclass
class ModelPlan:
    """What a checkpoint costs, computed from headers alone (used by open() and `moestream info`)."""

    family: object
    config: object
    layout: ExpertLayout
    store: ExpertStore
    dense_names: list[str]
    dense_bytes: int
    expert_bytes: int  # all routed experts
    max_expert_bytes: int
    scratch_bytes: int
    activation_row_bytes: int = 0  # fp32 activations one token of a step holds at its widest (activation_bytes)
    pair_row_bytes: int = 0  # fp32 per-slot expert outputs of one token under batch invariance (top_k x hidden)
    widest_input: int = 0  # the widest input of a 2-D dense weight (step_charge: the fixed-order kernel's panels)
    prompt_row_bytes: int = 0  # what a prompt row holds beyond activation_row_bytes (ACT_PROMPT_COPIES)

    @property
    def layer_reads_bytes(self) -> int:
        """2 x top_k of the largest expert: room for a layer step's reads in flight (the expert room a scheduler
        keeps by default, and the least `StepRoom` leaves the cache)."""
        return 2 * self.layout.top_k * self.max_expert_bytes


def model_config(path: str | Path):
    """(family, parsed config) of a checkpoint from its config.json alone (no shard headers read)."""
    path = model_path(path, full=False)  # hf://, https://: its stub (config and headers only)
    raw = read_model_config(path)
    family = family_for(raw)
    return family, parse_config(family.parse, raw, path)


# A step of many sequences (a batch job's decode step) makes its last-row logits this many rows at a time, as its
# caller samples them in order: 64 rows of a 160k vocabulary (Kimi K3) are 42 MB of fp32, where a 1,000-sequence
# step's whole [B, V] would be 655 MB beside the experts.
LOGIT_CHUNK_ROWS = 64
# A step of this many rows off the step heap (one with a prompt chunk under a scheduler, `_step_heap`; any where the
# heap settings are not in force) keeps its many-row products' buffers for its later layers (cpu.step_buffers):
# each layer asks for the same shapes, so their pages fault in once a step instead of once a layer. A 2,560-row
# prompt step of q3m_med in bf16 compute: 277 k page faults instead of 500 k, 0.2 s less, 4 MB higher peak
# (docs/performance.md).
STEP_BUFFER_ROWS = 256


class StepLogits(Sequence):
    """A wide step's last-row logits [V] per sequence, from its final-normed rows `x` [B, H]: `head` (the lm_head
    product) runs over LOGIT_CHUNK_ROWS rows at a time, under `math()` (the step's arithmetic settings), when a row
    of a chunk not yet made is read; the previous chunk is dropped first, so reading in order holds one chunk (a
    row the caller keeps keeps its chunk alive). Each row's values are those of the whole [B, V] product where the
    product's rows do not depend on one another (batch invariance); otherwise within its rounding."""

    def __init__(self, x: torch.Tensor, head, math):
        self.x, self.head, self.math = x, head, math
        self._at, self._rows = -1, None
        self.chunks = 0  # chunks made (a chunk read again after another is made again)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        if not isinstance(i, int):
            raise TypeError(f"StepLogits index must be an int, not {type(i).__name__}")
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        c, at = divmod(i, LOGIT_CHUNK_ROWS)
        if c != self._at:
            self._rows = None
            with self.math():
                self._rows = self.head(self.x[c * LOGIT_CHUNK_ROWS:(c + 1) * LOGIT_CHUNK_ROWS])
            self._at = c
            self.chunks += 1
        return self._rows[at]


# Steps of up to this many tokens run torch's ops on the calling thread alone (torch.set_num_threads(1) for the
# step), while the native pool keeps every thread: in such steps the weights go through the native kernels, and
# torch's ops are small (MLA's attention over a short cache, activations, index work). With torch's intra-op pool
# at 2 threads on a 2-core machine, its OpenMP worker polls after each of those small parallel regions on the core
# the native pool's worker needs (and the reverse): K3 at published width spent 36 ms of a 0.33 s warm decode step
# in MLA's torch attention with 2 torch threads, 4 ms with 1 (bench/k3_split.py --warm, docs/performance.md).
SERIAL_TORCH_TOKENS = 8


@contextlib.contextmanager
def serial_torch(on: bool) -> Iterator[None]:
    """torch's intra-op ops on the calling thread alone within the block (when `on` and torch has more threads)."""
    n = torch.get_num_threads()
    cpu.lib()  # loaded first: the native pool's default thread count is torch's at load time
    if not on or n <= 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def plan(path: str | Path, io_threads: int = IO_THREADS) -> ModelPlan:
    path = model_path(path, full=False)  # resolved once: model_config takes the local stub as it is
    family, cfg = model_config(path)
    index = _open_index(path, family, cfg)
    names = {n[len(family.prefix):] for n in index.names() if family.wants(n)}
    layout = family.experts(cfg, names)
    store = ExpertStore(index, layout.parts, layout.num_experts, family.prefix, io_threads)
    store.check_uniform(layout.moe_layers)
    dense = [n for n in index.names() if family.wants(n) and not store.is_expert_tensor(n)]
    dense_bytes = sum(index[n].nbytes for n in dense)
    per_layer = [[store.expert_nbytes(l, e) for e in range(layout.num_experts)] for l in layout.moe_layers]
    sizes = [b for row in per_layer for b in row]
    act, logit, hidden = _activation_row_bytes(index, dense)
    scratch = max(_scratch_bytes(index, dense, store, layout), _kda_scratch(cfg)) + ACT_FREE_ROWS * (act + logit)
    widest_input = max((index[n].shape[1] for n in dense if len(index[n].shape) == 2), default=0)
    return ModelPlan(family, cfg, layout, store, dense, dense_bytes, sum(sizes), max(sizes, default=0), scratch, act,
                     4 * layout.top_k * hidden, widest_input, 4 * ACT_PROMPT_COPIES * hidden)


ACT_HIDDEN_COPIES = 8  # [T, hidden] fp32 tensors a layer holds at once: residual, norm, attention in/out, MoE sum...
ACT_WIDE_COPIES = 3  # [T, widest] ones: a dense MLP's gate, up and activation (or q and its roped copy)
# A prompt row holds more at its widest than a decoding one (the prompt's attention: roped q and k copies, the fresh
# attention's inputs and output, its K / V rows quantised for the cache). Measured on q3m_med (hidden 1,024) with a
# scheduler's heap settings (the fixed mmap threshold and a trim after each layer, kept buffers for the dense
# products), beyond the new sequences' state: a 2,048-row prompt step 32 KiB a row over its start, 512 decoding +
# 32 prompts 32 KiB, 900 + 32 31 KiB, 1,000 decoding + 8 prompts 27 KiB, against the 44 KiB a row ACT_HIDDEN_COPIES
# and ACT_WIDE_COPIES charge (docs/performance.md, "Prompt rows charged what they hold"). Before the trims a
# 2,048-row prompt step peaked at 54-68 kB a row, and this was 6.
ACT_PROMPT_COPIES = 1  # [T, hidden] fp32 rows a prompt row holds beyond a decoding row's
# The fixed scratch allowance holds the activations of a step of this many tokens (decode batches, short prompts);
# a larger step charges the rest while it runs (Engine.activation_bytes), so a warm cache is not squeezed each step.
ACT_FREE_ROWS = 16


def _activation_row_bytes(index: CheckpointIndex, dense: list[str]) -> tuple[int, int, int]:
    """(fp32 activation bytes per token of a step at its widest point, fp32 bytes of one row of logits, the hidden
    size): a few hidden-wide rows plus the widest dense projection's outputs (a dense MLP's intermediate, the query
    heads). A step of thousands of rows (a batch job's prefill chunk) holds tens of MB of them."""
    shapes = [index[n].shape for n in dense if len(index[n].shape) == 2]
    if not shapes:
        return 0, 0, 0
    vocab = max(max(s) for s in shapes)  # embeddings and lm_head: their rows are the vocabulary, not activations
    hidden = max(min(s) for s in shapes)
    widest = max((s[0] for s in shapes if s[0] != vocab), default=hidden)
    return 4 * (ACT_HIDDEN_COPIES * hidden + ACT_WIDE_COPIES * widest), 4 * vocab, hidden


def _scratch_bytes(index: CheckpointIndex, dense: list[str], store: ExpertStore, layout: ExpertLayout) -> int:
    """Fixed compute scratch counted in the budget: one expert expanded to fp32 (or, for bf16 GLU experts, the
    native kernel's scratch of one call, which fused.moe_glu_bf16 keeps within that size), the slab that upcasts a
    half-precision dense weight (blocks.linear), the chunk a quantised dense weight decodes into, and the
    packed-expert decode slabs (kernels.quant, and the grouped decode of several resident experts in latent_moe),
    and for b12-coded experts the rows each thread of a GLU call decodes (fused.b12_scratch)."""
    half = [index[n].nbytes * 2 for n in dense if index[n].dtype in ("BF16", "F16")]
    scratch = min(UPCAST_CHUNK_BYTES, max(half, default=0))
    packed = [index[n].nbytes * (2 if index[n].dtype == "I32" else 1) for n in dense
              if index[n].dtype in ("F8_E4M3", "I32")]  # elements of quantised dense weights (kernels/qweight.py)
    if packed:
        scratch += dense_scratch_bytes(max(packed))
    if layout.moe_layers:
        locs = store.locate(layout.moe_layers[0], 0)
        scratch += sum(fp32_nbytes(loc) for loc in locs)
        if any(loc.dtype in ("U8", "I32", "F8_E4M3") for loc in locs):
            scratch += QUANT_SCRATCH_BYTES + GROUP_DECODE_BYTES
        coded = [max(loc.shape) for loc in locs if loc.codec is not None]
        if coded:  # b12 experts: the GLU call's rows decoded per thread, beyond the bf16 call's scratch
            scratch += b12_scratch(max(coded))
    return scratch


def _kda_scratch(cfg) -> int:
    """The smallest plan of a KDA chunked prefill (one head, one chunk): the scratch allowance holds at least that,
    since the compute phases (dense upcast, experts, attention tiles, KDA chunks) use it one after another."""
    raw = getattr(cfg, "raw", None) or {}
    opt = getattr(cfg, "kda", None) or (KDAOptions.from_hf(raw) if "linear_attn_config" in raw else None)
    if opt is None:
        return 0
    return chunk_plan(1, opt.chunk, opt.chunk, opt.head_dim, opt.head_dim, 0)[1]


def _open_index(path: str | Path, family, cfg) -> CheckpointIndex:
    if family.inventory is not None and Path(path).is_dir() and not CheckpointIndex.has_weights(path):
        return CheckpointIndex.virtual_from(path, family.inventory(cfg))
    return CheckpointIndex.open(path)


class Engine:
    def __init__(self, path: Path, p: ModelPlan, memory: MemoryAccountant, model, runner: ExpertRunner,
                 options: EngineOptions):
        self.path, self.plan, self.memory, self.model = path, p, memory, model
        self.runner, self.options = runner, options
        self.vocab_size = model.vocab_size
        self.residency: ResidencyPlan | None = None  # what stays resident and what streams (set by open)
        self._heap = HeapTrim()  # freed step temporaries back to the kernel (RSS beyond the books otherwise)
        self._resident: ResidentCheck | None = None  # measured RSS beyond the books (watch_resident)
        self._opened_anon = 0  # anonymous RSS when `open` began (StepRoom); 0: not measured

    @classmethod
    def open(cls, path: str | Path, ram_budget: str | int | None = None, device: str = "cpu",
             state_room: str | int | None = None, **options) -> "Engine":
        """Open a checkpoint (a directory, or a remote hf:// or https:// spec) under `ram_budget`. The residency plan keeps `state_room` bytes of the budget for KV
        caches and recurrent state when it decides which dense weights stream (default: none set aside)."""
        if device != "cpu":
            raise MoestreamError(f"device {device!r} is not supported yet; use device='cpu'")
        opened_anon = anon_rss()  # the process before any weight (StepRoom: RSS beyond it and the books)
        path = model_path(path)  # a remote checkpoint (hf://ORG/NAME[@REV], https://.../DIR/): its local stub
        opts = EngineOptions(ram_budget=parse_bytes(ram_budget), device=device, **options)
        kv_dtype(opts.kv_dtype)  # a bad --kv-dtype fails before anything is read
        check_compute_dtype(opts.compute_dtype)  # ... and a bad --compute-dtype
        if opts.batch_invariant and opts.compute_dtype != "fp32":
            raise MoestreamError("batch invariance (--batch-invariant) computes in fp32: it cannot go with "
                                 f"--compute-dtype {opts.compute_dtype}")
        if opts.threads:
            torch.set_num_threads(opts.threads)
            cpu.set_threads(opts.threads)  # the native kernels' pool too (without --threads: torch's count)
        p = plan(path, opts.io_threads)
        if p.store.index.virtual:
            raise CheckpointError(f"{path}: holds config.json but no safetensors weights: `moestream info` can size "
                                  "it, running it needs the shards")
        memory = MemoryAccountant(opts.ram_budget)
        # which dense weights stay resident; BudgetError when even streaming them cannot fit
        residency = plan_residency(p, opts.ram_budget, parse_bytes(state_room) or 0, opts.head_rows)
        memory.scratch_bytes = p.scratch_bytes
        memory.stream_reserve = residency.stream_buffer_bytes
        if residency.streams:
            memory.streamer = DenseStreamer(p.store.index, p.family.prefix, memory, residency, p.dense_names)
        return_freed_memory()  # freed temporaries leave the process, so RSS tracks what the budget counts
        runner = ExpertRunner(p.store, memory, opts.cache_policy, moe_layers=len(p.layout.moe_layers))
        weights = DenseWeights(p.store.index, p.family.prefix, memory)
        with tensors_fit_config(path):
            model = p.family.build(p.config, ModelContext(weights, runner, memory))
        _check_built(p, memory)
        eng = cls(Path(path), p, memory, model, runner, opts)
        eng.residency = residency
        eng._opened_anon = opened_anon
        return eng

    # ---- sequences and steps -------------------------------------------------------------------------
    def new_sequence(self) -> SeqState:
        state = self.model.new_state()
        state.kv_dtype = kv_dtype(self.options.kv_dtype)
        return state

    def free(self, state: SeqState) -> None:
        state.release()

    @torch.inference_mode()
    def step(self, items: list[tuple[SeqState, list[int]]], all_logits: bool = False) -> Sequence[torch.Tensor]:
        """Advance each sequence by its tokens in one forward pass. Returns per sequence the logits of its last
        token [V] (or of all its tokens [n, V] with all_logits). Past LOGIT_CHUNK_ROWS sequences (and with the
        lm_head in RAM) the last-token logits come as a `StepLogits`, made a chunk at a time as they are read in
        order: a caller charges LOGIT_CHUNK_ROWS rows of logits (`activation_bytes`), not one a sequence."""
        items = [(s, list(t)) for s, t in items if len(t) > 0]
        if not items:
            return []
        tokens = torch.tensor([t for _, toks in items for t in toks], dtype=torch.long)
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise RequestError(f"token ids must be in [0, {self.vocab_size}); "
                               f"got {int(tokens.min())}..{int(tokens.max())}")
        batch = Batch.build([(s, len(t)) for s, t in items])
        if all_logits:
            rows = torch.arange(tokens.shape[0])
        else:
            rows = torch.tensor([seg.start + seg.length - 1 for seg in batch.segments])
        # every position's logits exist while the step runs (their consumer's copy is charged by prefill); a batch
        # scheduler charges the rest of a large step's activations around it (activation_bytes)
        held = rows.shape[0] * self.vocab_size * 4 if all_logits else 0
        if self._resident is not None:
            self._resident.measure()  # what changed since the last step (sequences freed) before any expert is read
        chunked = self.logit_rows(rows.shape[0], all_logits) < rows.shape[0]  # made a chunk at a time as read
        with tensors_fit_config(self.path), transient(self.memory, held, "all-position logits"), \
                self._math(tokens.shape[0]), StepHeap.enter(tokens.shape[0], self._step_heap(items)) as heap, \
                cpu.step_buffers(tokens.shape[0] >= STEP_BUFFER_ROWS and not heap.active):
            room = StepRoom(self.memory, self._idle_buffers, self._opened_anon, self.plan.layer_reads_bytes) \
                if heap.active and self._resident is None and self.memory.limited else None
            try:
                self.model.after_layer = self._after_layer(room.layer_done if room is not None else heap.after_layer)
                logits = self.model.forward(tokens, batch, rows, head=not chunked)
            finally:
                self.model.after_layer = None
                self.runner.end_step()
                if room is not None:
                    room.done()
        self._heap.after_step()
        if self._resident is not None:
            self._resident.step_done()
            self._resident.measure()
        for s, t in items:
            s.pos += len(t)
        if chunked:
            return StepLogits(logits, self.model.head_rows, lambda: self._math(LOGIT_CHUNK_ROWS))
        if not all_logits:
            return list(logits.unbind(0))
        return [logits[seg.rows] for seg in batch.segments]

    def _after_layer(self, trim: Callable[[], None] | None) -> Callable[[], None] | None:
        """What runs after each layer of a step: off the step heap, the heap's trim; under a scheduler
        (`watch_resident`), the RSS measured beyond the books (`ResidentCheck.layer_done`), after the trim."""
        check = self._resident
        if check is None:
            return trim
        if trim is None:
            return check.layer_done
        return lambda: (trim(), check.layer_done())

    def _step_heap(self, items: list[tuple[SeqState, list[int]]]) -> bool:
        """Whether a large step runs on the step heap (StepHeap.enter): yes, except where a scheduler holds RSS to the
        budget (`watch_resident`) and the step carries a prompt chunk: then it keeps the fixed mmap threshold and trims
        the heap after each of its layers. A decode step's heap stays within what its caller charges for its activations
        (a 512-sequence q3m_med decode step peaked 17-22 MB over its start with it, 14-15 without, against 22 MB
        charged), where a 2,048-row prompt step's peaked 214-241 MB against 134-139 without and 87 charged. The decode
        steps' heap leaves a wide span of free, trimmed pages behind it (a 1,024-request job's arenas spanned 1 GB, 0.9
        GB of it free); a later prompt step's small blocks, carved from that span as the step goes, fault its pages in
        again: a step of 512 decoding rows and 8-16 prompts of 64 tokens peaked 85-244 MiB over its start beyond its new
        state against 57-91 MiB charged, and 27-66 MiB with a trim after each layer, which re-faults pages: 3-13% longer
        in isolation (docs/performance.md, "Free heap pages in a prompt step"). Under batch invariance a scheduler's
        decode steps keep the fixed setting too: on the step heap the arena grew step after step in the 1,024-request
        fp32 job (its free span 73 -> 430 MB over five 542-row steps, a step's peak 105 MiB over its end against 56
        MiB charged) and the job peaked 1.371 GB against its 1.233 GB bound; without, the arena stayed ~31 MB free and
        the job peaked 1.216-1.217 GB, 14-15% slower (94.2-95.9 against 111.4 tok/s; docs/performance.md, "The
        batch-invariant job's decode steps off the step heap")."""
        return self._resident is None or (not self.options.batch_invariant and all(len(t) == 1 for _, t in items))

    @contextlib.contextmanager
    def _math(self, rows: int) -> Iterator[None]:
        """The settings a step's arithmetic runs under: the compute dtype, batch invariance, torch's threads."""
        with torch.inference_mode(), \
                serial_torch(rows <= SERIAL_TORCH_TOKENS and not self.options.batch_invariant), \
                compute_dtype(self.options.compute_dtype, self.memory), invariant.mode(self.options.batch_invariant):
            yield

    def _idle_buffers(self) -> int:
        """Bytes of the reader's idle expert buffers (resident, covered by the cache's free room)."""
        return self.plan.store.reader.pool.idle_bytes

    def watch_resident(self, keep: int = 0) -> None:
        """From now on, book after each step the process's anonymous RSS grown beyond the books (engine/allocator.py
        `ResidentCheck`), so the expert cache makes room for it, all but `keep` bytes. For a process the engine
        owns (server, batch)."""
        if self._resident is None and self.memory.limited:
            self._resident = ResidentCheck(self.memory, self._idle_buffers, keep)

    def activation_bytes(self, rows: int, logit_rows: int, prompt_rows: int = 0) -> int:
        """What a step of `rows` tokens (`prompt_rows` of them in prompt chunks: items of more than one token)
        returning `logit_rows` rows of logits holds while it runs beyond the fixed scratch allowance (which holds
        ACT_FREE_ROWS rows of activations and as many rows of logits). The batch scheduler charges it around each
        step (a batch job's prefill chunk of thousands of tokens holds tens of MB); a single sequence's steps are
        bounded by --prefill-chunk and fit the allowance's order of size."""
        acts = max(0, rows - ACT_FREE_ROWS) * self.plan.activation_row_bytes + prompt_rows * self.plan.prompt_row_bytes
        return acts + max(0, logit_rows - ACT_FREE_ROWS) * self.vocab_size * 4

    def logit_rows(self, seqs: int, all_logits: bool = False) -> int:
        """Rows of logits a step of `seqs` sequences holds at once: one a sequence, or LOGIT_CHUNK_ROWS where
        `step` returns them as a StepLogits (for `activation_bytes`)."""
        return seqs if all_logits or not self.model.head_resident else min(seqs, LOGIT_CHUNK_ROWS)

    def step_charge(self, rows: int) -> int:
        """What a step of `rows` tokens charges to the budget itself while it runs, beyond `activation_bytes` (which
        its caller charges). Under batch invariance: the per-slot expert outputs (ExpertRunner._pair_buffer, held
        through the step beside every phase's scratch, so charged whole; top_k x hidden fp32 a token, an upper bound
        where experts output a narrower latent) and the fixed-order dense kernel's input panels at the widest dense
        input (models/blocks.linear), beyond the fixed scratch allowance as they are charged. A scheduler makes room
        for this too before the step: a BudgetError inside it fails every sequence in it."""
        if not self.options.batch_invariant or not self.memory.limited:
            return 0
        panels = cpu.fixed_scratch(rows, self.plan.widest_input) if cpu.available() else 0
        return rows * self.plan.pair_row_bytes + beyond_allowance(self.memory, panels)

    def prefill(self, state: SeqState, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Process a prompt in chunks of `prefill_chunk` tokens; returns the last (or all) logits. All positions'
        logits [n, V] fp32 are charged to the budget while they are filled (a BudgetError before a prompt whose
        logits do not fit starts); once returned they are the caller's."""
        chunk = max(1, self.options.prefill_chunk)
        if not all_logits or len(token_ids) <= chunk:  # one step's own (charged) logits are the answer
            for i in range(0, len(token_ids), chunk):
                (out,) = self.step([(state, token_ids[i:i + chunk])], all_logits=all_logits)
            return out
        with transient(self.memory, len(token_ids) * self.vocab_size * 4, "all-position logits"):
            out = torch.empty(len(token_ids), self.vocab_size)
            for i in range(0, len(token_ids), chunk):
                (out[i:i + chunk],) = self.step([(state, token_ids[i:i + chunk])], all_logits=True)
        return out

    # ---- the contract ----------------------------------------------------------------------------------
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 [len(token_ids), vocab] causal logits from a fresh state."""
        if len(token_ids) == 0:
            raise RequestError("logits() needs at least one token")
        state = self.new_sequence()
        try:
            return self.prefill(state, list(token_ids), all_logits=True).float()
        finally:
            self.free(state)

    def stream(self, token_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop_token_ids: list[int] | None = None) -> Iterator[int]:
        """Yield new tokens one at a time (the one generation loop). Stops at EOS/stop tokens (not yielded)."""
        params = SamplingParams(temperature, top_p, top_k, seed).validate()
        if len(token_ids) == 0:
            raise RequestError("the prompt must contain at least one token")
        if max_new_tokens < 0:
            raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        stops = set(stop_token_ids if stop_token_ids is not None else self.eos_token_ids)
        gen = params.generator() if temperature > 0 else None
        state = self.new_sequence()
        try:
            if max_new_tokens == 0:
                return
            logits = self.prefill(state, list(token_ids))
            for i in range(max_new_tokens):
                tok = sample(logits, params, gen)
                if tok in stops:
                    return
                yield tok
                if i + 1 < max_new_tokens:
                    (logits,) = self.step([(state, [tok])])
        finally:
            self.free(state)

    def generate(self, token_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop_token_ids: list[int] | None = None) -> list[int]:
        return list(self.stream(token_ids, max_new_tokens, temperature, top_p, top_k, seed, stop_token_ids))

    @property
    def eos_token_ids(self) -> list[int]:
        raw = getattr(self.plan.config, "raw", {}) or {}
        eos = raw.get("eos_token_id")
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list) else [int(eos)]

    @property
    def stats(self) -> dict:
        c = self.runner.cache
        return {
            "bytes_read": self.plan.store.bytes_read,
            "expert_hits": c.stats.hits,
            "expert_misses": c.stats.misses,
            "expert_evictions": c.stats.evictions,
            "expert_hit_rate": c.stats.hits / max(1, c.stats.hits + c.stats.misses),
            "peak_resident_bytes": self.memory.peak,
            "resident_bytes": self.memory.resident(),
            "dense_bytes": self.memory.dense_bytes,
            "state_bytes": self.memory.state_bytes,
            "cache_bytes": c.resident_bytes,
            "scratch_bytes": self.memory.scratch_bytes,
            "dense_streamed_layers": len(self.residency.streamed_layers) if self.residency else 0,
            "dense_stream_reserve_bytes": self.memory.stream_reserve,
            "dense_stream_bytes_read": self.memory.streamer.bytes_read if self.memory.streamer else 0,
            "dense_stream_wait_s": self.memory.streamer.wait_s if self.memory.streamer else 0.0,
            "ram_budget_bytes": self.memory.budget if self.memory.limited else None,
            "layer_hit_rates": c.stats.layer_hit_rates(),
        }

    def close(self) -> None:
        if self.memory.streamer is not None:
            self.memory.streamer.close()
        self.plan.store.close()


# what torch says when a tensor's shape disagrees with the sizes config.json gave the model
_SHAPE_ERRORS = ("shape", "size", "mat1 and mat2", "dimension", "index out of range", "must match", "expected")


@contextlib.contextmanager
def tensors_fit_config(path: str | Path) -> Iterator[None]:
    """A torch shape error while building or running the model is a checkpoint whose tensors do not fit its
    config.json (inputs are validated before they get here): report it as a CheckpointError, not a traceback."""
    try:
        yield
    except (RuntimeError, IndexError, ValueError) as e:
        if not any(m in str(e) for m in _SHAPE_ERRORS):
            raise
        raise CheckpointError(f"{path}: the checkpoint's tensors do not fit its config.json ({e})") from None


def _check_built(p: ModelPlan, memory: MemoryAccountant) -> None:
    """After the build: what the family actually keeps (including tensors it derives) leaves room for an expert."""
    if not memory.limited:
        return
    need = memory.fixed() + p.max_expert_bytes
    if need > memory.budget:
        raise BudgetError(
            f"--ram-budget {format_bytes(memory.budget)} ({memory.budget} bytes) leaves no room for one expert: "
            f"resident dense weights {format_bytes(memory.dense_bytes)} + dense stream buffers "
            f"{format_bytes(memory.stream_reserve)} + compute scratch {format_bytes(memory.scratch_bytes)} + one "
            f"expert {format_bytes(p.max_expert_bytes)} = {format_bytes(need)} ({need} bytes); the dense weights are "
            f"{format_bytes(p.dense_bytes)} ({p.dense_bytes} bytes)")
