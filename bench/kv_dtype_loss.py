"""Held-out loss of the built-in demo model run by the engine with fp32, bf16, int8 and int4 KV / latent caches.

The held-out text is train/data.py's split of the training text (every 20th block), encoded with the demo
checkpoint's tokenizer and cut into train/data.py's held-out windows (the training run's seq_len 128); each window
is one fresh sequence through `Engine.logits`. One JSON line.
    python bench/kv_dtype_loss.py [--windows 32] [--chars 200000]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from moestream import demo_model
from moestream.engine.engine import Engine
from moestream.bpe import default_training_text
from moestream.tokenizer import Tokenizer
from moestream.train import data


def heldout_loss(eng: Engine, windows: torch.Tensor) -> float:
    total, n = 0.0, 0
    for w in windows.tolist():
        logits = eng.logits(w[:-1])
        total += float(F.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum"))
        n += len(w) - 1
    return total / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--chars", type=int, default=200_000, help="held-out characters to encode")
    args = ap.parse_args()
    path = demo_model.path()
    opts = json.loads((path / "training.json").read_text())["options"]
    _, held = data.split_text(default_training_text(opts["text_bytes"]))
    tok = Tokenizer.load(path)
    tokens = data.encode(tok, held[:args.chars])
    windows = data.heldout_windows(tokens, opts["seq_len"], args.windows)
    out = {"windows": int(windows.shape[0]), "seq_len": opts["seq_len"], "tokens": int(windows[:, 1:].numel())}
    for kv in ("fp32", "bf16", "int8", "int4"):
        eng = Engine.open(path, kv_dtype=kv)
        out[f"{kv}_kv_loss"] = round(heldout_loss(eng, windows), 5)
        eng.close()
    for kv in ("bf16", "int8", "int4"):
        out[f"{kv}_delta"] = round(out[f"{kv}_kv_loss"] - out["fp32_kv_loss"], 5)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
