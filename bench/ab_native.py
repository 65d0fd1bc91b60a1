"""A/B of the native CPU kernels (moestream.kernels.cpu) inside the engine: warm decode steps of 1 and of 8
sequences with every expert resident, alternating torch paths, native on 1 thread and native on 2 threads.

    python bench/ab_native.py MODEL [--budget 8GiB] [--rounds 3] [--steps 8] [--warm 256]
Prints ms per step for each mode and round (one process, modes interleaved so that the shared machine's noise
hits all of them), then one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from moestream import Engine
from moestream.kernels import cpu

MODES = ["torch", "native 1 thread", "native 2 threads"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warm", type=int, default=256, help="prompt tokens that bring the experts in first")
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    a = ap.parse_args()
    if not cpu.available():
        raise SystemExit(cpu.reason())
    eng = Engine.open(a.model, ram_budget=a.budget)
    g = torch.Generator().manual_seed(0)
    seqs = [eng.new_sequence() for _ in range(8)]
    eng.prefill(seqs[0], torch.randint(0, eng.vocab_size, (a.warm,), generator=g).tolist())
    for s in seqs[1:]:
        eng.prefill(s, torch.randint(0, eng.vocab_size, (4,), generator=g).tolist())
    print(f"torch threads {torch.get_num_threads()}   hit rate after warm-up {eng.stats['expert_hit_rate']:.3f}")

    def ms(k: int) -> float:
        def run():
            for _ in eng.step([(s, [int(torch.randint(0, eng.vocab_size, (1,), generator=g))]) for s in seqs[:k]]):
                pass

        run()
        t = time.perf_counter()
        for _ in range(a.steps):
            run()
        return (time.perf_counter() - t) / a.steps * 1e3

    res: dict[str, list[tuple[float, float]]] = {}
    for _ in range(a.rounds):
        for mode in a.modes:
            cpu.set_threads(2 if mode.endswith("2 threads") else 1)
            with cpu.disabled() if mode == "torch" else contextlib.nullcontext():
                res.setdefault(mode, []).append((ms(1), ms(8)))
    cpu.set_threads(1)
    for mode, r in res.items():
        print(f"{mode:<18}", " ".join(f"1seq {x:.1f} ms, 8seq {y:.1f} ms;" for x, y in r))
    print(json.dumps({"model": str(a.model), "hit": eng.stats["expert_hit_rate"], "ms_per_step": res}))


if __name__ == "__main__":
    main()
