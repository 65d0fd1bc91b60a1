"""A/B of the MXFP4 expert paths on the demo model: one vs eight sequences per engine step.

Modes: per-expert or grouped (several resident experts per call), each with the torch kernels or the native ones
(moestream.kernels.cpu). All modes run alternately in one process (3 rounds) and print ms per step and the
8-vs-1 throughput ratio.
    python bench/ab_grouped.py [--rounds 3] [--steps 15] [--modes "torch grouped" "native grouped" ...]
"""
import argparse
import contextlib
import time

import torch

from moestream import Engine
from moestream.demo_model import path
from moestream.kernels import cpu
from moestream.models.latent_moe import LatentMoE

MODES = ["torch per-expert", "torch grouped", "native per-expert", "native grouped"]
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--steps", type=int, default=15)
parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
parser.add_argument("--cpu-time", action="store_true", help="time the calling thread's CPU time (use --threads 1)")
args = parser.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
clock = time.thread_time if args.cpu_time else time.perf_counter
print(f"native kernels: {cpu.available()} {cpu.reason()}   native threads {cpu.threads()}   "
      f"torch threads {torch.get_num_threads()}   clock {'thread CPU' if args.cpu_time else 'wall'}")
e = Engine.open(path())
g = torch.Generator().manual_seed(0)
seqs = [e.new_sequence() for _ in range(8)]
for s in seqs:
    e.step([(s, torch.randint(0, 4000, (16,), generator=g).tolist())])
moes = [layer.ffn for layer in e.model.layers if isinstance(layer.ffn, LatentMoE)]
groups = [m.group for m in moes]


def ms(k, n):
    def run():
        for _ in e.step([(s, [int(torch.randint(0, 4000, (1,), generator=g))]) for s in seqs[:k]]):
            pass

    run()
    t = clock()
    for _ in range(n):
        run()
    return (clock() - t) / n * 1e3


res = {}
for rnd in range(args.rounds):
    for mode in args.modes:
        for m, gr in zip(moes, groups):
            m.group = gr if mode.endswith("grouped") else None
        with cpu.disabled() if mode.startswith("torch") else contextlib.nullcontext():
            res.setdefault(mode, []).append((ms(1, args.steps), ms(8, args.steps)))
for mode, r in res.items():
    print(f"{mode:<18}", " ".join(f"1seq {a:.1f} ms, 8seq {b:.1f} ms, ratio {8 * a / b:.2f}x;" for a, b in r))
