"""Training the built-in demo model: a small Kimi K3-architecture code-completion model (`moestream train-demo`).

model.py is the trainable PyTorch module, kda.py its differentiable KDA, data.py the stdlib-source corpus and
tokenizer, loop.py the resumable training loop, export.py the official K3 checkpoint layout (MXFP4 experts),
recipe.py the end-to-end recipe and CLI. Nothing here is imported by the inference engine.
"""
from __future__ import annotations


def add_train_parser(subparsers):
    from moestream.train.recipe import add_train_parser as add

    return add(subparsers)


def run_train(args) -> int:
    from moestream.train.recipe import run_train as run

    return run(args)
