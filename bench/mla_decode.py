"""One MLA layer's decode step at Kimi K3's published width (synth/kimi_k3.py REAL): expanded vs absorbed.

Builds the layer's bf16 weights directly (about 0.5 GB, no checkpoint), prefills a context of `--context` tokens,
then times `--steps` single-token decode steps in each mode, side by side in one run. Run it under the bench lock:
    flock /work/bench.lock .venv/bin/python bench/mla_decode.py [--context 512] [--steps 8] [--modes expand,absorb]
        [--gemv]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from moestream.memory.accountant import MemoryAccountant
from moestream.memory.state import Batch, SeqState
from moestream.models.mla import MLAMixer, MLAOptions
from moestream.synth.kimi_k3 import REAL


class LayerWeights:
    """The tensors of one MLA layer by name, standing in for DenseWeights (bytes counted the same way)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.t, self.memory = tensors, MemoryAccountant(None)
        self.memory.add_dense(sum(t.numel() * t.element_size() for t in tensors.values()))

    def __contains__(self, name: str) -> bool:
        return name in self.t

    def get(self, name: str) -> torch.Tensor:
        return self.t[name]

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.t.get(name)


def k3_layer(seed: int = 0) -> tuple[LayerWeights, MLAOptions]:
    d = REAL
    g = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * cols ** -0.5).to(torch.bfloat16)

    qk = d.nope + d.rope
    t = {"a.q_a_proj.weight": w(d.q_lora, d.hidden), "a.q_a_layernorm.weight": torch.ones(d.q_lora),
         "a.q_b_proj.weight": w(d.heads * qk, d.q_lora), "a.kv_a_proj_with_mqa.weight": w(d.kv_lora + d.rope, d.hidden),
         "a.kv_a_layernorm.weight": torch.ones(d.kv_lora), "a.kv_b_proj.weight": w(d.heads * (d.nope + d.v), d.kv_lora),
         "a.g_proj.weight": w(d.heads * d.v, d.hidden), "a.o_proj.weight": w(d.hidden, d.heads * d.v)}
    opts = MLAOptions(heads=d.heads, kv_lora_rank=d.kv_lora, qk_nope_head_dim=d.nope, qk_rope_head_dim=d.rope,
                      v_head_dim=d.v, q_lora_rank=d.q_lora, rope=None, output_gate=True)
    return LayerWeights(t), opts


def run(mode: str, weights: LayerWeights, opts: MLAOptions, context: int, steps: int) -> dict:
    opts.mode = mode
    mixer = MLAMixer(weights, "a", opts)
    g = torch.Generator().manual_seed(1)
    state = SeqState(weights.memory, 1)
    x = torch.randn(context, REAL.hidden, generator=g)
    mixer(x, Batch.build([(state, context)]), 0)
    state.pos += context
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        mixer(torch.randn(1, REAL.hidden, generator=g), Batch.build([(state, 1)]), 0)
        times.append(time.perf_counter() - t0)
        state.pos += 1
    times = sorted(times[1:])  # the first step warms caches
    return {"mode": mode, "median_s": times[len(times) // 2], "min_s": times[0]}


def gemv_rates(weights: LayerWeights, opts: MLAOptions, repeats: int = 7) -> list[dict]:
    """Each dense projection of the layer at one token through blocks.linear (the native bf16 kernel), and the
    prepared kv_b per-head products of one absorbed decode step: median seconds and GB/s of weight bytes."""
    from moestream.models.blocks import linear

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[repeats // 2]

    rows = []
    for name, w in weights.t.items():
        if w.dim() == 2 and name != "a.kv_b_proj.weight":
            x = torch.randn(1, w.shape[1])
            sec = timed(lambda: linear(x, w))
            rows.append({"weight": name, "shape": list(w.shape), "seconds": sec,
                         "gb_per_s": w.numel() * w.element_size() / sec / 1e9})
    opts.mode = "absorb"
    heads = MLAMixer(weights, "a", opts).heads
    q, ctx = torch.randn(opts.heads, 1, opts.qk_nope_head_dim), torch.randn(opts.heads, 1, opts.kv_lora_rank)
    kv_b = weights.t["a.kv_b_proj.weight"]
    sec = timed(lambda: (heads.fold_query(q), heads.unfold_context(ctx)))
    rows.append({"weight": "kv_b fold + unfold (all heads)", "shape": list(kv_b.shape), "seconds": sec,
                 "gb_per_s": kv_b.numel() * kv_b.element_size() / sec / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", default="expand,absorb")
    ap.add_argument("--gemv", action="store_true", help="also time each projection's one-token GEMV")
    args = ap.parse_args()
    weights, opts = k3_layer()
    dense = sum(t.numel() * t.element_size() for t in weights.t.values())
    rows = [run(m, weights, opts, args.context, args.steps) for m in args.modes.split(",")]
    out = {"layer_weight_bytes": dense, "context": args.context, "threads": torch.get_num_threads(), "results": rows}
    if args.gemv:
        out["gemv"] = gemv_rates(weights, opts)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
