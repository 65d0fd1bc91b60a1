"""A/B of dense residency: decode speed with every dense weight resident vs about half the dense layers streamed
vs everything streamed (layers, embedding rows, lm_head slabs), the same expert cache room in each.

Each configuration gets a budget from the residency planner: the all-resident budget, then that budget less half
the layers' bytes (plus their double buffer), then the streaming floor; every budget keeps room for all experts
and the KV cache, so after a warm-up the experts are cached and only the dense streaming differs. The modes run
alternately in one process (--rounds), each decoding --steps tokens after a warm-up; median ms per token printed.
    python bench/ab_residency.py MODEL [--rounds 3] [--steps 16] [--threads 0]
"""
import argparse
import statistics
import time

import torch

from moestream import Engine
from moestream.config import format_bytes
from moestream.engine.engine import plan
from moestream.engine.residency import plan_residency

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("model")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--steps", type=int, default=16)
parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
args = parser.parse_args()

p = plan(args.model)
room = 2 * p.expert_bytes + (64 << 20)  # every expert (with read alignment) and the KV cache
full = plan_residency(p, None, room)
layers = sorted(full.layers, key=lambda lr: lr.bytes)
half = sum(lr.bytes for lr in layers[: len(layers) // 2])
budgets = {"all resident": full.all_resident_budget,
           "half streamed": full.all_resident_budget - half + 2 * max(lr.bytes for lr in layers),
           "all streamed": full.min_ram_budget}
engines = {}
for name, budget in budgets.items():
    eng = Engine.open(args.model, ram_budget=budget, state_room=room)
    r = eng.residency
    print(f"{name:14s} budget {format_bytes(budget)}: {len(r.streamed_layers)}/{len(r.layers)} layers streamed, "
          f"embedding {'rows' if r.embed_streamed else 'resident'}, "
          f"lm_head {'slabs' if r.head_streamed else 'resident'}"
          f", {format_bytes(r.streamed_bytes_per_step)} dense read per step, "
          f"dense resident {format_bytes(r.resident_dense_bytes)}")
    engines[name] = eng
if args.threads:
    torch.set_num_threads(args.threads)

ids = list(range(3, 35))
times: dict[str, list[float]] = {name: [] for name in engines}
waits: dict[str, float] = {name: 0.0 for name in engines}
for eng in engines.values():  # warm-up: the experts the continuation routes to get cached
    eng.generate(ids, args.steps, stop_token_ids=[])
outs = {}
for _ in range(args.rounds):
    for name, eng in engines.items():
        state = eng.new_sequence()
        logits = eng.prefill(state, ids)
        toks = []
        w0 = eng.stats["dense_stream_wait_s"]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tok = int(logits.argmax())
            toks.append(tok)
            (logits,) = eng.step([(state, [tok])])
        times[name].append((time.perf_counter() - t0) / args.steps)
        waits[name] += eng.stats["dense_stream_wait_s"] - w0
        eng.free(state)
        outs.setdefault(name, toks)
base = statistics.median(times["all resident"])
for name, ts in times.items():
    ms = statistics.median(ts)
    s = engines[name].stats
    wait = 1000 * waits[name] / (args.rounds * args.steps)
    print(f"{name:14s} {1000 * ms:8.1f} ms/token  {1 / ms:6.2f} tok/s  x{base / ms:.2f} of all-resident  "
          f"waited for reads {wait:.1f} ms/token  "
          f"peak {format_bytes(s['peak_resident_bytes'])} <= {format_bytes(budgets[name])}: "
          f"{s['peak_resident_bytes'] <= budgets[name]}  tokens equal: {outs[name] == outs['all resident']}")
