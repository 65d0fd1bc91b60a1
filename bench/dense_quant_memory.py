"""Peak extra memory and time of one block-FP8 dense linear at DeepSeek-V3's o_proj shape (7168 x 16384, 128 x 128
scales): the old whole-weight dequantisation (`w.float()`, then one matmul) against blocks.linear's row chunks.

Each way runs in its own process; the peak RSS above the state before the call is read from VmHWM after resetting
it (/proc/self/clear_refs). Run under the bench lock:
    flock /work/bench.lock .venv/bin/python bench/dense_quant_memory.py [--tokens 1,16,512]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

OUT, IN, BLOCK = 7168, 16384, (128, 128)


def _kib(field: str) -> int:
    from moestream.cgroup import proc_kib

    got = proc_kib(field)
    if got is None:
        raise RuntimeError(field)
    return got


def weight():
    from moestream.kernels.qweight import BlockFp8Weight

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (OUT, IN), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    scales = torch.rand(OUT // BLOCK[0], IN // BLOCK[1], generator=g) * 1e-3 + 1e-4
    return BlockFp8Weight.wrap(codes.view(torch.float8_e4m3fn), scales, BLOCK)


def measure(way: str, tokens: int) -> dict:
    from moestream.kernels.quant import dequant_fp8_block
    from moestream.models.blocks import linear

    w = weight()
    x = torch.randn(tokens, IN, generator=torch.Generator().manual_seed(1))  # the same x both ways
    call = (lambda: linear(x, w)) if way == "chunked" else \
        (lambda: F.linear(x, dequant_fp8_block(w.codes, w.scale_inv, w.block)))
    best, y = float("inf"), None
    for _ in range(2):
        y = None
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _kib("VmRSS")
        t0 = time.perf_counter()
        y = call()
        best = min(best, time.perf_counter() - t0)
        peak = _kib("VmHWM") - base
    return {"way": way, "tokens": tokens, "peak_extra_mib": round(peak / 1024, 1), "seconds": round(best, 4),
            "checksum": float(y.double().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,512")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # way tokens: the child process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for way in ("dequantise-all", "chunked"):
            out = subprocess.run([sys.executable, __file__, "--one", way, str(tokens)], capture_output=True,
                                 text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"shape": [OUT, IN], "block": BLOCK, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
