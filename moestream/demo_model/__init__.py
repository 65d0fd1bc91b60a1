"""The built-in demo model: a small Kimi K3-architecture Python code-completion model shipped as package data.

Owns only where the checkpoint lives (this folder: config.json, MXFP4 shards, tokenizer, training.json) and the
prompt it is best shown with. How it was made: `moestream train-demo`, documented in docs/demo-model.md.
Nothing in this folder is executed by the engine; this file only locates the data next to it.
"""
from __future__ import annotations

from pathlib import Path

from moestream.errors import CheckpointError

DEMO_PROMPT = "def fibonacci(n):\n"
PROMPTS = ("def fibonacci(n):\n", "class Stack:\n")


def path() -> Path:
    """The checkpoint directory; raises if the package was installed without its data files."""
    root = Path(__file__).resolve().parent
    if not (root / "config.json").is_file():
        raise CheckpointError(f"the demo checkpoint is missing from {root}: reinstall moestream with its package "
                              "data, or rebuild it with `moestream train-demo --export " + str(root) + "`")
    return root
