"""The whole demo-model recipe behind `moestream train-demo`: train, export, measure, sample, report.

Owns the model sizes ("demo" is the shipped one, "tiny" is for tests), the held-out comparison of the trained
fp32 model against its bf16 form and its MXFP4 export, greedy completions of Python prompts, and the CLI
parser. Training itself is loop.py, the checkpoint format export.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from moestream.tokenizer import Tokenizer
from moestream.train import data
from moestream.train.export import export_checkpoint, load_checkpoint
from moestream.train.loop import TrainOptions, heldout_loss, train
from moestream.train.model import DemoConfig, DemoK3

SIZES = {
    "demo": DemoConfig(),
    "tiny": DemoConfig(vocab_size=512, hidden_size=64, num_layers=4, intermediate_size=128, num_experts=8, top_k=2,
                       moe_intermediate_size=32, latent_size=32, num_shared_experts=1, kda_heads=2,
                       kda_head_dim=32, mla_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                       qk_rope_head_dim=8, v_head_dim=16),
}
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n", "import os\n\n\ndef list_files(path):\n",
           "    def __repr__(self):\n"]
FINAL_EVAL_WINDOWS = 128


@torch.no_grad()
def complete(model: DemoK3, tok: Tokenizer, prompt: str, max_new_tokens: int = 64) -> str:
    """Greedy continuation with the training model (full recompute per token: short prompts only)."""
    model.eval()
    ids = tok.encode(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return tok.decode(ids[len(tok.encode(prompt)):])


def evaluate_forms(model: DemoK3, tok_dir: Path, export_dir: Path, windows: torch.Tensor,
                   extra: dict) -> dict:
    """Held-out loss of the fp32 model, its bf16 checkpoint and its MXFP4 export (written to export_dir)."""
    fp32 = heldout_loss(model, windows)
    with tempfile.TemporaryDirectory() as tmp:
        export_checkpoint(model, tok_dir, Path(tmp) / "bf16", quantize=False)
        bf16 = heldout_loss(load_checkpoint(Path(tmp) / "bf16"), windows)
    summary = export_checkpoint(model, tok_dir, export_dir, quantize=True, extra=extra)
    mxfp4 = heldout_loss(load_checkpoint(export_dir), windows)
    tokens = int(windows[:, 1:].numel())
    return {"heldout_tokens": tokens, "checkpoint_bytes": summary["bytes"],
            **{f"{k}_loss": v for k, v in (("fp32", fp32), ("bf16", bf16), ("mxfp4", mxfp4))},
            **{f"{k}_ppl": float(torch.tensor(v).exp()) for k, v in (("fp32", fp32), ("bf16", bf16), ("mxfp4", mxfp4))}}


def run_recipe(opts: TrainOptions, export_dir: Path, progress: bool = True, samples: bool = True) -> dict:
    """Train (or resume) to opts.steps, export, and write the report into export_dir/training.json."""
    model, run, tok_dir = train(opts, progress=progress)
    corpus, _ = data.prepare(Path(opts.out_dir), opts.text_bytes, opts.model.vocab_size)
    windows = data.heldout_windows(corpus.heldout, opts.seq_len, FINAL_EVAL_WINDOWS)
    extra = {"recipe": "moestream train-demo", "steps": run.step, "train_tokens_seen": run.tokens,
             "train_seconds": round(run.seconds, 1), "corpus": corpus.summary(),
             "options": {k: v for k, v in dataclasses.asdict(opts).items() if k not in ("out_dir", "model")},
             "model": opts.model.to_dict(), "final_train_loss": run.losses[-1][1] if run.losses else None,
             "evals": run.evals, "expert_usage_last_interval": run.usage}
    report = evaluate_forms(model, tok_dir, export_dir, windows, extra)
    if samples:
        tok = Tokenizer.load(export_dir)
        exported = load_checkpoint(export_dir)
        report["samples"] = {p: complete(exported, tok, p) for p in PROMPTS}
    full = {**extra, **report}
    (Path(export_dir) / "training.json").write_text(json.dumps(full, indent=2) + "\n")
    return full


# ---- CLI ------------------------------------------------------------------------------------------------------
def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-demo", help="train the small K3-architecture demo model on Python's stdlib",
                              description="Train the built-in demo model (resumable), export it as an MXFP4 K3 "
                                          "checkpoint and report held-out loss and sample completions.")
    d = TrainOptions(out_dir=Path("."))
    p.add_argument("--out", type=Path, default=Path("moestream-train-demo"), help="run directory (resumes if a "
                   "train_state.pt is there)")
    p.add_argument("--export", type=Path, default=None, help="where to write the checkpoint (default OUT/model)")
    p.add_argument("--size", choices=sorted(SIZES), default="demo")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--decay-steps", type=int, default=d.decay_steps, help="final steps of linear LR decay; "
                   "before they start, resuming with another --steps reproduces a run launched with it")
    p.add_argument("--text-bytes", type=int, default=d.text_bytes, help="bytes of stdlib source to use")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--checkpoint-seconds", type=float, default=d.checkpoint_seconds)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_train)
    return p


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(out_dir=args.out, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                        lr=args.lr, decay_steps=args.decay_steps, text_bytes=args.text_bytes, threads=args.threads,
                        seed=args.seed, eval_every=args.eval_every, checkpoint_seconds=args.checkpoint_seconds,
                        model=dataclasses.replace(SIZES[args.size]))


def run_train(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    report = run_recipe(opts, args.export or Path(args.out) / "model", progress=not args.no_progress)
    print(f"held-out loss: fp32 {report['fp32_loss']:.4f}  bf16 {report['bf16_loss']:.4f}  "
          f"mxfp4 {report['mxfp4_loss']:.4f} (perplexity {report['mxfp4_ppl']:.2f})")
    for prompt, text in report.get("samples", {}).items():
        print(f"--- {prompt!r}\n{prompt}{text}")
    return 0
