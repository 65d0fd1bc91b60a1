"""`moestream plan`'s result: a checkpoint's facts, a budget, this machine's calibrated rates (or a stated
reference machine's) and a skew assumption turned into decode / prefill / batch speed, TTFT, how many sequences'
state fits, and cost per million tokens, with every assumption listed.

Owns the options, the default budget (a share of the memory available here), the reference machines, where the
disk probe reads (the model's shards; for a config-only or remote checkpoint, a scratch file where they would
live) and the JSON-ready result. The arithmetic is predict.py's; the rates are calibrate.py's.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from moestream.cgroup import memory_available
from moestream.config import COMPUTE_DTYPE_NAMES, DEFAULT_BUDGET_SHARE, format_bytes
from moestream.errors import MoestreamError
from moestream.planner.calibrate import Calibrator, Overhead, Rates
from moestream.planner.facts import ModelFacts, model_facts, open_plan
from moestream.planner.predict import Scenario
from moestream.planner.skew import Skew
from moestream.weights import pages as weight_pages

SCHEDULER_CHUNK = 256  # the server scheduler's default prompt tokens per step (SchedulerConfig.prefill_chunk)
ENGINE_CHUNK = 512  # the engine's default prefill chunk (EngineOptions.prefill_chunk)
OS_RESERVE = 8 << 30  # a reference machine's RAM the budget leaves to the OS and the interpreter
# Default routing: `moestream trace` of the built-in demo model, a trained K3-architecture router: top-10% shares
# 0.17-0.21 per layer fit Zipf exponents 0.30-0.40 (skew.fit_exponent; mean 0.34), P(reuse next) 0.07-0.16 (mean
# 0.12) (docs/plan.md). Random-weight synthetic routers measured more skewed: --skew 0.64 --reuse 0.25.
DEFAULT_SKEW = Skew(0.35, "default: `moestream trace` of the trained demo model; random-weight synthetic "
                          "checkpoints trace at --skew 0.64 --reuse 0.25", 0.12)
# A reference machine's engine overhead per layer step (not measurable from here): 0.3 ms of non-kernel work per
# decode layer measured on one idle Zen 3 core (docs/performance.md, decode step split), 0.05 ms per extra row,
# 5 ms per prefill chunk.
REFERENCE_OVERHEAD = Overhead(0.3e-3, 0.05e-3, 5e-3, "assumed for reference machines: docs/performance.md's "
                                                       "0.3 ms of non-kernel work per decode layer")


@dataclass(frozen=True)
class Machine:
    """A stated reference machine: RAM, disk, and the rates assumed for its kernels."""

    name: str
    ram: int
    disk: float
    gemv_bf16: float
    gemv_mxfp4: float
    expand_bf16: float
    expand_mxfp4: float
    gemm_flops: float
    memory: float
    note: str

    def rates(self, here: Rates) -> Rates:
        """Its rates: bf16 and MXFP4 as stated, other formats at this machine's ratio to bf16; overheads assumed."""
        gemv = {k: self.gemv_bf16 * v / here.gemv["bf16"] for k, v in here.gemv.items()}
        expand = {k: self.expand_bf16 * v / here.expand["bf16"] for k, v in here.expand.items()}
        gemv.update(bf16=self.gemv_bf16, mxfp4=self.gemv_mxfp4)
        expand.update(bf16=self.expand_bf16, mxfp4=self.expand_mxfp4)
        overhead = {k: REFERENCE_OVERHEAD for k in here.overhead}
        # a missed expert's fresh buffer pages: this machine's rate scaled by the memory bandwidths' ratio
        pages = here.page_faults * self.memory / here.memory if here.memory > 0 else 0.0
        glu = self.gemv_bf16 * here.glu / here.gemv["bf16"] if here.glu else 0.0  # this machine's ratio to bf16
        # a reference machine is not a VM whose host takes freed pages back: no deep memory
        return Rates(gemv, expand, self.gemm_flops, self.memory, self.disk, overhead, pages, glu=glu,
                     source={"all": f"reference machine {self.name}: {self.note}"})

    def describe(self) -> str:
        return (f"{self.name}: {format_bytes(self.ram)} RAM, disk {self.disk / 1e9:g} GB/s, one-row bf16 "
                f"{self.gemv_bf16 / 1e9:g} GB/s, MXFP4 {self.gemv_mxfp4 / 1e9:g} GB/s, fp32 expansion bf16 "
                f"{self.expand_bf16 / 1e9:g} GB/s, MXFP4 {self.expand_mxfp4 / 1e9:g} GB/s, fp32 GEMM {self.gemm_flops / 1e12:g} TFLOP/s, memory "
                f"{self.memory / 1e9:g} GB/s ({self.note})")


MACHINES = {m.name: m for m in (
    Machine("desktop-64g", 64 << 30, 7e9, 40e9, 30e9, 12e9, 8e9, 1.0e12, 60e9,
            "8-core desktop, dual-channel DDR5, PCIe 4 NVMe"),
    Machine("server-512g", 512 << 30, 14e9, 150e9, 100e9, 40e9, 30e9, 5.0e12, 300e9,
            "32-core server, 8-channel DDR5, PCIe 5 NVMe"),
)}


@dataclass
class PlanOptions:
    ram_budget: int | None = None
    batch: int | None = None
    prompt_len: int = 512
    gen_len: int = 256
    disk_bandwidth: float | None = None  # None: probe (cached)
    price_per_hour: float | None = None
    skew: Skew = DEFAULT_SKEW
    calibrate: bool = False
    machine: str | None = None  # plan for a reference machine instead of this one
    reference: bool = False  # also plan every reference machine
    kv_dtype: str = "fp32"  # KV / latent cache storage (--kv-dtype): sets the state per sequence and its work
    compute_dtype: str = "fp32"  # --compute-dtype: many-row steps' bf16 products at the bf16 probes' rates
    skew_from: str | None = None  # a `moestream trace` file, or "model": trace the local weights' own router
    skew_tokens: int = 0  # tokens a --skew-from model trace routes (0: routing.TRACE_TOKENS)
    save_skew: str | None = None  # --save-skew: write the --skew-from model trace's routing report here
    probe_seconds: float = 1.0
    # streamed dense reads (layers, head slabs), bytes/s; None: probed (bench.probe_stream), or disk_bandwidth if given
    stream_bandwidth: float | None = None
    log: Callable[[str], None] = field(default=lambda msg: None)

    def check(self) -> None:
        if self.batch is not None and self.batch < 1:
            raise MoestreamError(f"--batch must be at least 1, got {self.batch}")
        if self.prompt_len < 1 or self.gen_len < 1:
            raise MoestreamError("--prompt-len and --gen-len must be at least 1")
        for flag, rate in (("--disk-bandwidth", self.disk_bandwidth), ("--stream-bandwidth", self.stream_bandwidth)):
            if rate is not None and not (rate > 0 and math.isfinite(rate)):
                raise MoestreamError(f"{flag} must be a positive number of bytes/s, got {rate}")
        if self.price_per_hour is not None and not self.price_per_hour >= 0:
            raise MoestreamError(f"--price-per-hour must be >= 0, got {self.price_per_hour}")
        if self.compute_dtype not in COMPUTE_DTYPE_NAMES:
            raise MoestreamError(f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPE_NAMES)}, got "
                                 f"{self.compute_dtype!r}")
        if self.machine is not None and self.machine not in MACHINES:
            raise MoestreamError(f"unknown --machine {self.machine!r}; choose from {', '.join(MACHINES)}")
        if self.skew.exponent < 0 or not math.isfinite(self.skew.exponent):
            raise MoestreamError(f"--skew must be a finite exponent >= 0, got {self.skew.exponent}")
        if not 0.0 <= self.skew.reuse <= 1.0:
            raise MoestreamError(f"--reuse must be a probability in [0, 1], got {self.skew.reuse}")


def default_budget() -> int:
    """The budget planned for this machine without --ram-budget: DEFAULT_BUDGET_SHARE of the memory available
    (cgroup.memory_available; 16 GiB where /proc/meminfo cannot be read), which `run` takes for a model that does
    not fit in it (cli/common.resolve_budget); one that fits runs with no limit, and the plan is the same."""
    room = memory_available()
    return int(DEFAULT_BUDGET_SHARE * (room if room is not None else 16 << 30))


def measured_skew(path: str | Path, opts: PlanOptions, facts: ModelFacts) -> Skew:
    """--skew-from: the routing of a `moestream trace` file or routing report, or of a short trace of the model's
    own router ("model"; local weights only), kept in opts.save_skew when given. An explicit --reuse replaces the
    trace's."""
    from moestream.planner.skew import from_report, from_trace_file

    if opts.skew_from == "model":
        if facts.info.config_only:
            raise MoestreamError("--skew-from model needs the checkpoint's weights; this one has config.json / "
                                 "headers only (trace it where the weights are: `moestream trace --save FILE`)")
        from moestream.planner.routing import TRACE_TOKENS, trace_model

        opts.log(f"tracing the model's router over {opts.skew_tokens or TRACE_TOKENS} random tokens (--skew-from model)")
        report = trace_model(path, opts.skew_tokens or TRACE_TOKENS)
        if opts.save_skew:
            Path(opts.save_skew).write_text(json.dumps(report))
        got = from_report(report, report["source"])
    else:
        try:
            got = from_trace_file(opts.skew_from)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MoestreamError(f"--skew-from {opts.skew_from}: {e}") from None
    if got.weights is not None and len(got.weights) != facts.num_experts:
        opts.log(f"--skew-from: the trace has {len(got.weights)} experts a layer, the model {facts.num_experts}: "
                 "its Zipf fit is used")
    if "--reuse" in opts.skew.source.split(" and "):
        got = replace(got, reuse=opts.skew.reuse, source=got.source + "; --reuse given")
    return got


def make_plan(path: str | Path, opts: PlanOptions) -> dict:
    opts.check()
    p = open_plan(path)
    try:
        facts = model_facts(path, p, opts.kv_dtype)
        if opts.machine is None and opts.ram_budget:  # a budget too small is an error now, not after the probes
            facts.fit(p, opts.ram_budget)
        if opts.skew_from:
            opts.skew = measured_skew(path, opts, facts)
        cal = Calibrator(fresh=opts.calibrate, seconds=opts.probe_seconds, log=opts.log)
        kinds = set(facts.dense_bytes) | {facts.expert_kind, facts.head_kind}
        here = cal.rates(kinds, facts.model_type, facts.top_k, facts.num_experts, facts.probe_shapes(), facts.widths,
                         facts.glu_shape(), facts.dense_probe_shapes(), opts.kv_dtype, facts.expert_codec,
                         opts.compute_dtype)
        if opts.disk_bandwidth is not None:
            here.disk, here.source["disk"] = opts.disk_bandwidth, "--disk-bandwidth"
        elif opts.machine is None:
            target = _probe_target(Path(path))
            here.disk, here.source["disk"] = cal.disk(*target)
            if opts.stream_bandwidth is None:
                here.disk_stream, here.source["disk_stream"] = cal.disk_stream(*target)
        if opts.stream_bandwidth is not None and opts.machine is None:
            here.disk_stream, here.source["disk_stream"] = opts.stream_bandwidth, "--stream-bandwidth"
        if opts.machine is not None:
            m = MACHINES[opts.machine]
            out = _predict(facts, p, m.rates(here), opts.ram_budget or m.ram - OS_RESERVE, opts, m.describe())
        else:
            budget = opts.ram_budget or default_budget()
            out = _predict(facts, p, here, budget, opts, "this machine (calibrated)")
        if opts.reference:
            out["reference_machines"] = [_predict(facts, p, m.rates(here), m.ram - OS_RESERVE, opts, m.describe())
                                         for m in MACHINES.values()]
    finally:
        p.store.close()
    out["model"] = _model_summary(facts)
    out["assumptions"] = assumptions(facts, opts, out)
    return out


def _probe_target(path: Path) -> tuple[list[Path], Path]:
    """(files to probe, where): the model's local shards, or a scratch file where the shards would be."""
    from moestream.bench import model_files
    from moestream.weights.remote import SETTINGS, manifest_of

    if manifest_of(path):  # remote: shards are read through the disk cache (or over HTTP: not modelled)
        where = SETTINGS.disk_cache or path
        return [], Path(where)
    return [f for f in model_files(path) if f.stat().st_size >= 8 << 20], path


def _predict(facts: ModelFacts, p, rates: Rates, budget: int, opts: PlanOptions, machine: str) -> dict:
    per_seq = facts.state.at(opts.prompt_len, opts.prompt_len + opts.gen_len, SCHEDULER_CHUNK)
    fit = facts.fit(p, budget, per_seq)  # dense residency keeps room for one sequence (as --state-room would)
    sc = Scenario(facts, fit, rates, opts.skew, compute_dtype=opts.compute_dtype, huge_pages=weight_pages.enabled())
    context = opts.prompt_len + opts.gen_len / 2  # mean context over the generated tokens
    # one stream from an engine just opened (as `moestream run` / `bench --cold`): its prompt fills the cache, and
    # the cached experts it did not use miss on first use during the generation; the steady state has none of these
    one = sc.decode(1, context, per_seq, since_open=(opts.prompt_len, opts.gen_len))
    steady = sc.decode(1, context, per_seq)
    warm = sc.prefill(opts.prompt_len, ENGINE_CHUNK, cold=False)
    cold = sc.prefill(opts.prompt_len, ENGINE_CHUNK, cold=True)
    ttft, ttft_cold = sum(s.seconds for s in warm), sum(s.seconds for s in cold)
    # many sequences (the batch job, the server) run without the head's resident rows unless --state-room is given
    many = facts.fit(p, budget, per_seq, head_rows=False) if fit.residency.head_resident_rows else fit
    room = many.cache_bytes - p.layer_reads_bytes  # the scheduler's expert room
    max_seq = max(0, room // per_seq) if per_seq > 0 else None
    out = {
        "machine": machine, "ram_budget_bytes": budget,
        "decode_tokens_per_s": 1.0 / one.seconds, "decode_step": _step_json(one),
        "decode_steady_tokens_per_s": 1.0 / steady.seconds,
        "prefill_tokens_per_s": opts.prompt_len / ttft, "ttft_s": ttft,
        "prefill_cold_tokens_per_s": opts.prompt_len / ttft_cold, "ttft_cold_s": ttft_cold,
        "max_sequences": max_seq, "state_bytes_per_sequence": per_seq, "state_room_bytes": max(0, room),
        "expert_hit_rate": one.hit_rate, "experts_cached": fit.experts_fit, "experts_total": fit.experts_total,
        "kv_dtype": opts.kv_dtype, "compute_dtype": opts.compute_dtype,
        "cache_bytes": fit.cache_bytes, "resident_dense_bytes": fit.residency.resident_dense_bytes,
        "streamed_dense_bytes_per_step": fit.residency.streamed_bytes_per_step,
        "disk_bytes_per_token": one.expert_reads * facts.expert_bytes + fit.residency.streamed_bytes_per_step,
        "rates": rates.to_json(),
    }
    if sc.replayed:
        out["decode_cache_replay"] = sc.replayed
    if opts.batch is not None:
        n = max(1, min(opts.batch, max_seq or 1)) if max_seq is not None else opts.batch
        sc_many = sc if many is fit else Scenario(facts, many, rates, opts.skew, compute_dtype=opts.compute_dtype,
                                                  huge_pages=sc.huge_pages)
        step = sc_many.decode(n, context, n * per_seq, since_open=(opts.prompt_len, opts.gen_len))
        out.update({"batch": opts.batch, "batch_sequences": n, "batch_tokens_per_s": n / step.seconds,
                    "batch_step": _step_json(step)})
        if sc_many.replayed_batch:
            out["batch_cache_replay"] = sc_many.replayed_batch
    if opts.price_per_hour is not None:
        out["cost_per_million_tokens"] = _cost(opts.price_per_hour, out["decode_tokens_per_s"])
        if "batch_tokens_per_s" in out:
            out["batch_cost_per_million_tokens"] = _cost(opts.price_per_hour, out["batch_tokens_per_s"])
    return out


def _cost(price_per_hour: float, tokens_per_s: float) -> float:
    return price_per_hour / 3600.0 / tokens_per_s * 1e6 if tokens_per_s > 0 else math.inf


def _step_json(s) -> dict:
    return {"seconds": s.seconds, "io_s": s.io_s, "compute_s": s.compute_s, "overhead_s": s.overhead_s,
            "wait_s": s.wait_s, **({"layer_step": s.detail} if s.detail else {}),
            "experts_read": s.expert_reads, "hit_rate": s.hit_rate, "compute_parts": s.parts}


def _model_summary(f: ModelFacts) -> dict:
    i = f.info
    return {"path": f.path, "model_type": f.model_type, "layers": f.num_layers, "moe_layers": f.moe_layers,
            "experts": f.num_experts, "top_k": f.top_k, "expert_bytes": f.expert_bytes, "expert_format": f.expert_kind,
            "expert_codec": f.expert_codec or None,
            "dense_bytes": i.dense_bytes, "expert_bytes_total": i.expert_bytes,
            "cold_expert_bytes_per_token": i.expert_bytes_per_token_cold, "active_params": i.active_params,
            "total_params": i.total_params, "min_ram_budget": i.min_ram_budget, "config_only": i.config_only,
            "state": f.state.describe()}


def _glu_format(f: ModelFacts) -> str:
    return f"{f.expert_codec}-coded bf16" if f.expert_codec else "bf16"


def assumptions(f: ModelFacts, opts: PlanOptions, out: dict) -> list[str]:
    r = out["rates"]
    src = r.get("source", {})
    o = Rates.from_json(r).overhead_for(f.model_type, f.top_k, f.widths)
    lines = [
        f"routing: {opts.skew.describe()}; the cache also holds the previous token's experts when it has room",
        "expert cache: the budget's cache holds each MoE layer's most popular experts, shared evenly by the "
        f"{f.moe_layers} MoE layers (LFRU's steady state); sequence state grows into the same room",
        f"disk: {r['disk'] / 1e9:.3g} GB/s for expert reads"
        + (f"; streamed dense layers and lm_head slabs at {r['disk_stream'] / 1e9:.3g} GB/s "
           f"({src.get('disk_stream', '')})" if r.get("disk_stream") else " and streamed dense weights")
        + f" ({src.get('disk', src.get('all', ''))})",
        "compute: one-row weight kernels at " + ", ".join(f"{k} {v / 1e9:.3g} GB/s" for k, v in r["gemv"].items())
        + "; multi-row weights expanded to fp32 at " + ", ".join(f"{k} {v / 1e9:.3g} GB/s"
                                                                 for k, v in r["expand"].items())
        + f" then fp32 GEMM at {r['gemm_flops'] / 1e9:.3g} GFLOP/s; state read at {r['memory'] / 1e9:.3g} GB/s"
        + (f"; one-row {_glu_format(f)} GLU experts, a layer's top-{f.top_k} in one fused native call, at "
           f"{r['glu'] / 1e9:.3g} GB/s{' of coded bytes' if f.expert_codec else ''} ({src.get('glu', '')})"
           if r.get("glu") and f.expert_kind == "bf16" else "")
        + (f" (kernels probed at {src['shapes']}; {src.get('gemv ' + f.expert_kind, '')})"
           if src.get("shapes") else ""),
        "overlap: one-row decode step = overhead + max(all reads, compute + the layer steps' read waits); "
        "multi-row step (a batch, a prompt chunk) = its layer-by-layer timeline (below)",
        "a multi-row step, layer by layer (as experts/dispatch.py runs it): per MoE layer step the main thread "
        "runs the mixer, router and engine overhead, then the layer's cached experts in one grouped call while "
        "the misses' reads run, then each read expert as it lands, in queue order; the disk serves the reads one "
        "after another at its rate; a scanning step (routing to at least half a layer's experts) holds at most its "
        "read window of reads (experts.dispatch.scan_window) and, once a layer's reads are all queued, reads the "
        "next layer's ahead into the free room; a step that evicts queues all its reads at once and reads nothing "
        "ahead; streamed dense layers are read one layer ahead; nothing is read across steps; misses spread evenly "
        "over the layers (whole reads); the lm_head after the last layer"
        + (f"; {_glu_format(f)} GLU experts at the fused call's measured many-row times ({src.get('glu_rows', 'source not recorded')}), a layer step's "
           "hits grouped, each read expert alone, linear between the probed row counts"
           if r.get("glu_rows") and f.expert_kind == "bf16" else
           "; routed experts over several rows expanded to fp32 and multiplied by the fp32 GEMM (no many-row "
           "kernel measured for this format)")
        + "; each read expert also costs the main thread the overhead probe's per-miss engine work (landing, "
        "bookkeeping, the spill; below)",
        "dense residency planned keeping one sequence's state free (`--state-room` that size; the engine's "
        "default keeps none, so state then squeezes the expert cache)",
        f"state: {f.state.describe()}; sequences sized at {opts.prompt_len} prompt + {opts.gen_len} generated "
        "tokens, admitted while their state fits the budget less the scheduler's room for 2 x top_k experts",
        f"decode at the mean context ({opts.prompt_len} + {opts.gen_len}/2 tokens), one stream of an engine just "
        f"opened: the cached experts its {opts.prompt_len}-token prompt did not route to miss on first use, "
        f"averaged over the {opts.gen_len} generated tokens (decode_steady_tokens_per_s: without them, a server's "
        f"later requests); prefill in chunks of "
        f"{ENGINE_CHUNK}; ttft_s with the cache at its steady share, ttft_cold_s with an empty cache",
    ]
    probed = r.get("dense_rows") or {}
    kinds = [f"dense weights over {len(probed)} probed shapes (" + ", ".join(probed) + "): blocks.linear timed "
             "over 1-256 rows (bf16 weights in fp32 and bf16 compute, block-FP8 in fp32), each weight priced at the "
             "probed shape of its format nearest in size, scaled by its parameters (one row: only weights of 16 MiB "
             "or more, and the lm_head; smaller ones at the one-row kernel's rate)"] if probed else \
        ["dense weights: one-row kernel rate and fp32 expansion + GEMM (no dense shape probed)"]
    lines.append(f"compute dtype {opts.compute_dtype}: " + (
        "steps of 16+ rows multiply bf16 dense weights in bf16 (blocks.BF16_MIN_ROWS), and the routed "
        "bf16 GLU experts too (BF16_GLU_MIN_ROWS) at the fused call's bf16 many-row times; MXFP4 experts take "
        "bf16-rounded activations at every row count (their one-row rate probed so); other one-row products and "
        "routers stay fp32" if opts.compute_dtype == "bf16" else "fp32 products at every row count")
        + "; " + kinds[0])
    kv = (r.get("kv") or {}).get(opts.kv_dtype)
    if opts.kv_dtype != "fp32":
        lines.append(f"--kv-dtype {opts.kv_dtype}: " + (
            "its storage work beyond fp32's per layer with a cache (quantise on write, dequantise on read; "
            f"{src.get('kv ' + opts.kv_dtype, '')}): one-row decode {kv.get('decode_s', 0) * 1e6:.3g} us + "
            f"{kv.get('decode_row_s', 0) * 1e9:.3g} ns per token of context, batch decode "
            f"{kv.get('batch_s', 0) * 1e6:.3g} us + {kv.get('batch_row_s', 0) * 1e9:.3g} ns per sequence, "
            f"prompts {kv.get('prefill_token_s', 0) * 1e6:.3g} us per token" if kv else
            "its storage work (quantise on write, dequantise on read) not measured for this machine: priced as "
            "fp32's"))
    if out.get("decode_cache_replay"):
        lines.append("one-stream decode hit rate: the measured routing replayed through the engine's cache "
                     f"({out['decode_cache_replay']}, capacity {out['experts_cached']} experts less the state's "
                     "room); batch and steady-state figures from the measured popularity of each layer"
                     + (" (but the batch's reads: below)" if out.get("batch_cache_replay") else ""))
    if out.get("batch_cache_replay"):
        lines.append("batch reads: the measured routing of as many recorded prompts as the batch has sequences, "
                     f"decoding together through the engine's cache from empty ({out['batch_cache_replay']}): each "
                     "sequence's own experts stay cached for its next tokens")
    if o is not None:
        lines.append(f"engine overhead per layer step: {o.decode_s * 1e3:.3g} ms decode + "
                     f"{o.decode_row_s * 1e3:.3g} ms per extra row, {o.prefill_s * 1e3:.3g} ms per prefill "
                     f"chunk ({o.source})")
        pages, deep = r.get("page_faults") or 0.0, r.get("deep_faults") or 0.0
        if deep:
            deep_note = (f", and once the process holds twice {format_bytes(r['hot_bytes'])} of fresh memory (its "
                         f"hot memory; linear from there) at {deep / 1e9:.3g} GB/s "
                         f"({f.expert_bytes / deep * 1e3:.3g} ms an expert; {src.get('deep_faults', '')})"
                         + ("; the resident dense weights' huge pages not counted in it (they take the deep memory "
                            "themselves)" if weight_pages.enabled() else ""))
        else:  # measured, no slowdown seen; or not measured (reference machines)
            deep_note = f" (fresh memory held: {src['deep_faults']})" if src.get("deep_faults") else ""
        lines.append(f"a one-row decode step, layer by layer: a MoE layer step with misses leaves the warm path "
                     f"({o.general_s * 1e3:.3g} ms, its lookahead router {o.lookahead_s * 1e3:.3g} ms of it, which "
                     "every layer step runs while the cache lacks an expert) and each expert read on a miss costs "
                     f"{o.miss_s * 1e3:.3g} ms of engine work beyond a hit's (the overhead probe decoded warm, off the "
                     "warm path, and under a budget where most experts miss) plus its multiply by the one-expert "
                     "kernel; the layer step computes its hits while its reads run and each read expert as it "
                     "lands, so it waits for max(0, reads + the last expert's work - its work), the reads being "
                     "its misses at the disk's rate after the first buffer's page faults"
                     + (f" ({f.expert_bytes / pages * 1e3:.3g} ms at {pages / 1e9:.3g} GB/s; "
                        f"{src.get('page_faults', '')})" if pages > 0 else " (page faults not measured)")
                     + deep_note
                     + "; misses per layer step spread as the replayed routing's (else binomial around the mean)")
    if not opts.ram_budget:
        lines.append(f"no --ram-budget: planned at {DEFAULT_BUDGET_SHARE:.0%} of the memory available here (as `run` "
                     "takes it where the model does not fit; a model that fits runs with no limit, and the same "
                     "plan), a reference machine at its RAM less 8 GiB")
    if out["max_sequences"] == 0:
        lines.append("not one sequence's state fits beside the scheduler's expert room: the server would refuse "
                     "requests of this length (raise --ram-budget or shorten --prompt-len / --gen-len)")
    if opts.batch is not None and out.get("batch_sequences", opts.batch) < opts.batch:
        lines.append(f"--batch {opts.batch}: only {out['batch_sequences']} sequences' state fits; the batch "
                     "figures are for that many")
    return lines
