"""Peak memory of one prefill chunk's attention, full score matrix vs key tiles (models/tiled.py), at a width where
the difference shows: hidden 1024 as 16 query heads x 64 (4 KV heads), a 4096-token chunk on an empty cache.
Each form runs in a fresh process; the figure is peak RSS minus RSS once the inputs exist. One JSON line each.
    python bench/attention_memory.py [--tokens 4096]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def rss_mib() -> float:
    from moestream.cgroup import proc_kib

    return (proc_kib("VmRSS") or 0) / 1024


def run(form: str, tokens: int) -> None:
    import torch

    from moestream.memory.accountant import MemoryAccountant
    from moestream.memory.state import SeqState, Segment
    from moestream.models.attention import KVSlot, attend, cached_attention, causal_mask

    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = torch.randn(tokens, 16, 64), torch.randn(tokens, 4, 64), torch.randn(tokens, 4, 64)
    mem = MemoryAccountant(None)
    slot = KVSlot(mem, 4, 64, 64)
    seg = Segment(SeqState(mem, 1), 0, tokens, 0)
    base = rss_mib()
    if form == "full":  # what cached_attention did before: the [Hkv, G*T, L] scores, mask and probabilities
        out = attend(q, slot.k.append(k), slot.v.append(v), causal_mask(0, tokens, tokens), 0.125)
    else:
        out = cached_attention(seg, slot, q, k, v, 0.125)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"form": form, "tokens": tokens, "heads": 16, "kv_heads": 4, "head_dim": 64,
                      "peak_over_inputs_mib": round(peak - base, 1), "kv_cache_mib": round(mem.state_bytes / 2**20, 1),
                      "scores_fp32_mib": 16 * tokens * tokens * 4 / 2**20, "out_sum": float(out.sum())}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--form", choices=("full", "tiled"))
    args = ap.parse_args()
    if args.form:
        run(args.form, args.tokens)
        return
    for form in ("full", "tiled"):
        subprocess.run([sys.executable, __file__, "--form", form, "--tokens", str(args.tokens)], check=True)


if __name__ == "__main__":
    main()
