"""Kimi K3 at published width: a decode step split by op, the bytes each part moves, and decode tok/s against
the every-byte roofline (issue #12 target 3, issue #13's K3 streaming target).

Each op is timed exclusively (a nested op's time is its own, not its caller's): every dense projection by weight
(MLA, KDA, dense MLP, shared expert, latent down / up, lm_head), MLA's kv_b fold and unfold, MLA attention, the
router, the routed experts (compute, and I/O wait apart), dense-layer stream waits, AttnRes reads; what no op
claims is "python/other". The every-byte roofline of a token is
    expert bytes read + streamed dense bytes      at the probed disk bandwidth
  + resident dense bytes used + cached expert bytes used   at the measured memory bandwidth,
summed (no overlap credited: `roofline_overlap_tok_s` is the stricter bound that credits full overlap).
Run it under the bench lock, e.g.
    flock /work/bench.lock python bench/k3_split.py /work/synth/k3_fw --ram-budget 4.5GiB --threads 2 \
        --prompt-len 32 --gen-len 16 --cold --lookahead on,off,open
"""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from moestream import Engine
from moestream.bench import drop_page_cache, model_files, probe_disk
from moestream.config import parse_bytes
from moestream.kernels import cpu
from moestream.kernels.quant import bandwidth_probe
from moestream.models import attnres, base, blocks, kda, latent_moe, mla

CATEGORIES = (  # (name fragment, category), first match wins
    ("self_attn.kv_b", "mla kv_b"), ("self_attn.q_a", "mla proj"), ("self_attn.q_b", "mla proj"),
    ("self_attn.kv_a", "mla proj"), ("self_attn.g_proj", "attn g/o proj"), ("self_attn.o_proj", "attn g/o proj"),
    ("self_attn.", "kda proj"), (".mlp.", "dense mlp"), ("shared_experts", "shared expert"),
    ("routed_expert_", "latent down/up"), ("lm_head", "lm_head"),
)


def category(name: str) -> str:
    return next((c for frag, c in CATEGORIES if frag in name), "other linear")


class Split:
    """Exclusive wall time and weight bytes per op; patches module functions and instance attributes."""

    def __init__(self) -> None:
        self.secs: dict[str, float] = defaultdict(float)
        self.nbytes: dict[str, int] = defaultdict(int)
        self.stack: list[float] = []  # child seconds of each open op
        self.names: dict[int, str] = {}  # id(weight) -> checkpoint name
        self.streamed: set[int] = set()  # ids of weights the residency plan streams (their bytes come from disk)
        self.resident = 0  # bytes of resident weights multiplied since reset()
        self.undo: list[tuple[object, str, object]] = []

    def timed(self, key, fn, nbytes=None):
        def run(*a, **kw):
            k = key(*a) if callable(key) else key
            self.stack.append(0.0)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t
                child = self.stack.pop()
                self.secs[k] += dt - child
                if self.stack:
                    self.stack[-1] += dt
                if nbytes is not None:
                    self.nbytes[k] += nbytes(*a)
        return run

    def patch(self, obj, attr: str, key, nbytes=None) -> None:
        fn = getattr(obj, attr)
        self.undo.append((obj, attr, fn))
        setattr(obj, attr, self.timed(key, fn, nbytes))

    def restore(self) -> None:
        for obj, attr, fn in reversed(self.undo):
            setattr(obj, attr, fn)
        self.undo.clear()

    def reset(self) -> None:
        self.secs.clear()
        self.nbytes.clear()
        self.resident = 0

    def used(self, w: torch.Tensor, parts: int = 1) -> int:
        """w's bytes (1/parts of them), counted as resident bytes moved when w is a known weight that does not
        stream."""
        n = weight_bytes(w) // parts
        if id(w) in self.names and id(w) not in self.streamed:
            self.resident += n
        return n


def weight_bytes(w: torch.Tensor) -> int:
    return w.numel() * w.element_size()


def instrument(eng, split: Split, weights) -> None:
    split.names = {id(t): n for n, t in weights.loaded.items()}
    streamer = eng.memory.streamer
    split.streamed = {id(t) for n, t in weights.loaded.items() if streamer is not None and streamer.streams(n)}

    def lin_key(x, w, *_):
        return category(split.names.get(id(w), "?"))

    def lin_bytes(x, w, *_):
        return split.used(w)

    for mod in (mla, blocks, latent_moe, base, kda):
        split.patch(mod, "linear", lin_key, lin_bytes)
    # MLA's attention core: tiled.attend_tiles since the cache is read by blocks (tiled_causal_attention before)
    split.patch(mla, "attend_tiles" if hasattr(mla, "attend_tiles") else "tiled_causal_attention", "mla attention")
    split.patch(attnres, "attn_res_read", "attnres + norms")
    model = eng.model
    for layer in model.layers:
        m = layer.mixer
        if isinstance(m, mla.MLAMixer):
            half = (lambda _, h=m.heads: split.used(h.kv_b, 2))  # each product reads one half of kv_b
            split.patch(m.heads, "fold_query", "mla kv_b", half)
            split.patch(m.heads, "unfold_context", "mla kv_b", half)
        else:
            split.patch(layer, "mixer", "kda recurrence")
        f = layer.ffn
        if isinstance(f, latent_moe.LatentMoE):
            split.patch(f, "route", "router", lambda x: 0)
            split.patch(f.runner, "run", "routed experts")
    split.patch(model, "enter_layer", "dense stream wait")
    split.patch(model, "embed", "embedding")
    if model.residency is not None:
        split.patch(model.residency, "head", "lm_head")


def decode(eng, opts, split: Split) -> dict:
    gen = torch.Generator().manual_seed(opts.seed)
    prompt = torch.randint(0, eng.vocab_size, (opts.prompt_len,), generator=gen).tolist()
    state = eng.new_sequence()
    runner, store = eng.runner, eng.plan.store
    streamer = eng.memory.streamer
    t0 = time.perf_counter()
    logits = eng.prefill(state, prompt)
    ttft = time.perf_counter() - t0
    split.reset()
    a = (store.bytes_read, runner.cache.stats.hits, runner.cache.stats.misses, runner.times.io_wait_s,
         streamer.bytes_read if streamer else 0)
    wall, ids = 0.0, []
    for _ in range(opts.gen_len):
        tok = int(logits.argmax()) if opts.temperature <= 0 else int(
            torch.multinomial(torch.softmax(logits.float() / opts.temperature, -1), 1, generator=gen))
        ids.append(tok)
        t = time.perf_counter()
        (logits,) = eng.step([(state, [tok])])
        wall += time.perf_counter() - t
    b = (store.bytes_read, runner.cache.stats.hits, runner.cache.stats.misses, runner.times.io_wait_s,
         streamer.bytes_read if streamer else 0)
    eng.free(state)
    n = opts.gen_len
    io_wait = (b[3] - a[3]) / n
    secs = {k: v / n for k, v in split.secs.items()}
    if "routed experts" in secs:  # the runner's I/O wait apart from expert compute
        secs["routed experts"] -= io_wait
        secs["expert io wait"] = io_wait
    secs["python/other"] = wall / n - sum(secs.values())
    hits, misses = b[1] - a[1], b[2] - a[2]
    return {"ttft_s": ttft, "decode_tok_s": n / wall, "step_s": wall / n, "ids": ids,
            "expert_bytes_read_per_token": (b[0] - a[0]) / n, "streamed_dense_bytes_per_token": (b[4] - a[4]) / n,
            "expert_hits_per_token": hits / n, "expert_misses_per_token": misses / n,
            "seconds_per_token": dict(sorted(secs.items(), key=lambda kv: -kv[1])),
            "weight_bytes_per_token": {k: v / n for k, v in split.nbytes.items()},
            "resident_dense_bytes_per_token": split.resident / n}


def roofline(r: dict, expert_bytes: int, resident_bytes: float, disk_bw: float, mem_bw: float) -> dict:
    disk = r["expert_bytes_read_per_token"] + r["streamed_dense_bytes_per_token"]
    ram = resident_bytes + r["expert_hits_per_token"] * expert_bytes
    t_disk, t_ram = disk / disk_bw, ram / mem_bw
    roof = 1.0 / (t_disk + t_ram)
    return {"disk_bytes_per_token": disk, "ram_bytes_per_token": ram, "disk_s": t_disk, "ram_s": t_ram,
            "roofline_tok_s": roof, "roofline_fraction": r["decode_tok_s"] / roof,
            "roofline_overlap_tok_s": 1.0 / max(t_disk, t_ram)}


def streaming(r: dict, expert_bytes: int, mem_bw: float) -> dict:
    """Weight bytes a decode token reads from RAM (resident dense weights and cached experts) over the step time,
    against the measured read bandwidth (issue #13's streaming target), and each part's own rate (its bytes over
    its exclusive time)."""
    ram = r["ram_bytes_per_token"]
    parts = {k: {"bytes": b, "s": r["seconds_per_token"].get(k, 0.0),
                 "gb_s": b / r["seconds_per_token"][k] / 1e9 if r["seconds_per_token"].get(k) else None}
             for k, b in r["weight_bytes_per_token"].items() if b}
    # the runner's time less its I/O wait computes every routed expert of the token, read ones included
    experts = (r["expert_hits_per_token"] + r["expert_misses_per_token"]) * expert_bytes
    t = r["seconds_per_token"].get("routed experts", 0.0)
    parts["routed experts (computed)"] = {"bytes": experts, "s": t, "gb_s": experts / t / 1e9 if t else None}
    return {"ram_bytes_per_token": ram, "step_s": r["step_s"], "rate_gb_s": ram / r["step_s"] / 1e9,
            "mem_bw_gb_s": mem_bw / 1e9, "fraction": ram / r["step_s"] / mem_bw, "parts": parts}


def run_once(path: Path, opts, lookahead: str, mem_bw: float) -> dict:
    """One fresh engine; `lookahead` "on" (the default recall gate), "off", or "open" (gate forced open from the
    first step, `--lookahead-reads` predicted experts read ahead per layer step)."""
    files = model_files(path)
    if opts.cold:
        drop_page_cache(files)
    disk_bw = probe_disk(files, 8)
    split = Split()
    captured = []
    init = base.DenseWeights.__init__

    def keep(self, *a, **kw):
        init(self, *a, **kw)
        captured.append(self)

    base.DenseWeights.__init__ = keep
    try:
        eng = Engine.open(path, ram_budget=opts.ram_budget, threads=opts.threads, compute_dtype=opts.compute_dtype)
    finally:
        base.DenseWeights.__init__ = init
    try:
        if opts.native_threads:
            cpu.set_threads(opts.native_threads)
        if opts.torch_threads:
            torch.set_num_threads(opts.torch_threads)
        la = eng.runner.lookahead
        la.enabled = lookahead != "off"
        if lookahead == "open":
            la.threshold, la.warmup, la.reads = 0.0, 0, opts.lookahead_reads
        if opts.warm:  # the same prompt and samples once untimed: every expert the timed pass routes to is cached
            decode(eng, opts, split)
        instrument(eng, split, captured[0])
        r = decode(eng, opts, split)
        resident = r["resident_dense_bytes_per_token"]
        r["streamed_tensors"] = len(split.streamed)
        store = eng.plan.store
        one = store.expert_nbytes(eng.plan.layout.moe_layers[0], 0)  # K3's experts are all alike
        r.update(roofline(r, one, resident, disk_bw, mem_bw))
        r["streaming"] = streaming(r, one, mem_bw)
        r.update({"lookahead": lookahead, "disk_bw": disk_bw, "mem_bw": mem_bw, "expert_bytes": one,
                  "prefetch_reads": eng.runner.times.prefetch_reads, "prefetch_used": eng.runner.times.prefetch_used})
    finally:
        split.restore()
        eng.runner.finish()
        eng.close()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--ram-budget", default="4.5GiB")
    ap.add_argument("--threads", type=int, default=None, help="the engine's --threads (torch and native alike)")
    ap.add_argument("--native-threads", type=int, default=None, help="then override the native kernels' threads")
    ap.add_argument("--torch-threads", type=int, default=None, help="then override torch's intra-op threads")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cold", action="store_true", help="drop the model's pages before each run")
    ap.add_argument("--warm", action="store_true",
                    help="decode the same prompt and samples once untimed first, so the timed pass finds its experts "
                         "cached (with a budget that holds them): the `streaming` entry is then the warm step's rate")
    ap.add_argument("--lookahead", default="on",
                    help="comma-separated runs, one fresh engine each: on (default gate), off, open (gate forced open)")
    ap.add_argument("--lookahead-reads", type=int, default=4, help="experts read ahead per layer step with `open`")
    ap.add_argument("--compute-dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the engine's --compute-dtype (bf16: MXFP4 experts take bf16-rounded activations in decode)")
    opts = ap.parse_args()
    opts.ram_budget = parse_bytes(opts.ram_budget)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    mem_bw = bandwidth_probe(512 << 20)  # with the engine's threads, whatever --torch-threads says
    if opts.torch_threads:
        torch.set_num_threads(opts.torch_threads)
    variants = opts.lookahead.split(",")
    if any(v not in ("on", "off", "open") for v in variants):
        ap.error(f"--lookahead takes on, off and open; got {opts.lookahead!r}")
    out = [run_once(opts.model, opts, v, mem_bw) for v in variants]
    threads = {"threads": opts.threads, "native_threads": cpu.threads(), "torch_threads": torch.get_num_threads(),
               "compute_dtype": opts.compute_dtype}
    print(json.dumps({**threads, "runs": out}, indent=1, default=float))


if __name__ == "__main__":
    main()
