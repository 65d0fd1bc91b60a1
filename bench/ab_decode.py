"""Engine-API-only decode timing, for before/after comparisons across source trees (run it with PYTHONPATH set
to the tree under test). Cold page cache for the model's files, seeded sampled decode, one JSON line out.
    PYTHONPATH=/tmp/before python bench/ab_decode.py MODEL BUDGET [--gen-len 16]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("budget", type=int)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lookahead", action="store_true")
    a = ap.parse_args()
    for f in a.model.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    import moestream
    from moestream import Engine

    torch.set_num_threads(a.threads)
    eng = Engine.open(a.model, ram_budget=a.budget)
    torch.set_num_threads(a.threads)
    if hasattr(eng.runner, "lookahead"):
        eng.runner.lookahead.enabled = a.lookahead
    g = torch.Generator().manual_seed(0)
    st = eng.new_sequence()
    t0 = time.perf_counter()
    logits = eng.prefill(st, torch.randint(0, eng.vocab_size, (a.prompt_len,), generator=g).tolist())
    ttft = time.perf_counter() - t0
    b0, t1 = eng.stats["bytes_read"], time.perf_counter()
    for _ in range(a.gen_len):
        tok = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        (logits,) = eng.step([(st, [tok])])
    dt = time.perf_counter() - t1
    s = eng.stats
    print(json.dumps({"tree": str(Path(moestream.__file__).parent.parent), "decode_tok_s": a.gen_len / dt,
                      "prefill_tok_s": a.prompt_len / ttft, "MB_per_tok": (s["bytes_read"] - b0) / a.gen_len / 1e6,
                      "hit": s["expert_hit_rate"], "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "budget_MB": a.budget / 1e6}))


if __name__ == "__main__":
    main()
