"""A/B of the grouped MXFP4 expert decode on the demo model: one vs eight sequences per engine step.

Runs both modes alternately in one process (3 rounds) and prints ms per step and the 8-vs-1 throughput ratio.
    python bench/ab_grouped.py
"""
import time, torch
from moestream import Engine
from moestream.demo_model import path
from moestream.models.latent_moe import LatentMoE
e = Engine.open(path())
g = torch.Generator().manual_seed(0)
seqs = [e.new_sequence() for _ in range(8)]
for s in seqs: e.step([(s, torch.randint(0, 4000, (16,), generator=g).tolist())])
moes = [l.ffn for l in e.model.layers if isinstance(l.ffn, LatentMoE)]
groups = [m.group for m in moes]
def ms(k, n=15):
    run = lambda: e.step([(s, [int(torch.randint(0, 4000, (1,), generator=g))]) for s in seqs[:k]])
    run(); t = time.perf_counter()
    for _ in range(n): run()
    return (time.perf_counter() - t) / n * 1e3
res = {}
for rnd in range(3):
    for mode in ("per-expert", "grouped"):
        for m, gr in zip(moes, groups): m.group = gr if mode == "grouped" else None
        res.setdefault(mode, []).append((ms(1), ms(8)))
for mode, r in res.items():
    print(mode, " ".join(f"1seq {a:.1f} ms, 8seq {b:.1f} ms, ratio {8*a/b:.2f}x;" for a, b in r))
