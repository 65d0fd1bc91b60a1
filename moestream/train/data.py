"""Training data for the demo model: the Python standard library's own sources, a BPE trained on them, batches.

Owns splitting the text into train and held-out parts (every k-th 64 KiB block is held out, so both see the
same mix of modules), training the byte-level BPE on the train part, encoding once (cached as a tensor file),
and the deterministic batches: batch i depends only on (seed, i), which is what makes a resumed run identical.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.errors import MoestreamError
from moestream.bpe import default_training_text, train_bpe_tokenizer
from moestream.tokenizer import Tokenizer

BLOCK_CHARS = 65536
HELDOUT_EVERY = 20  # one block in 20 (5%) is held out


@dataclass
class Corpus:
    train: torch.Tensor  # int32 token ids
    heldout: torch.Tensor
    text_bytes: int

    def summary(self) -> dict:
        return {"train_tokens": int(self.train.numel()), "heldout_tokens": int(self.heldout.numel()),
                "text_bytes": self.text_bytes}


def split_text(text: str, every: int = HELDOUT_EVERY, block: int = BLOCK_CHARS) -> tuple[str, str]:
    """(train, held-out): blocks cut at line ends, every `every`-th one held out (smaller blocks for small texts)."""
    block = max(1024, min(block, len(text) // (every * 4)))
    blocks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + block)
        end = len(text) if end < 0 else end + 1
        blocks.append(text[start:end])
        start = end
    held = [b for i, b in enumerate(blocks) if i % every == every - 1]
    train = [b for i, b in enumerate(blocks) if i % every != every - 1]
    return "".join(train), "".join(held)


def prepare(work_dir: Path, text_bytes: int, vocab_size: int, text: str | None = None) -> tuple[Corpus, Path]:
    """Tokenizer (work_dir/tokenizer) and encoded corpus (work_dir/tokens.pt), built once and reused on resume."""
    tok_dir, cache = work_dir / "tokenizer", work_dir / "tokens.pt"
    if cache.is_file() and (tok_dir / "tokenizer.json").is_file():
        data = torch.load(cache)
        return Corpus(data["train"], data["heldout"], data["text_bytes"]), tok_dir
    text = default_training_text(text_bytes) if text is None else text
    train_text, held_text = split_text(text)
    if not held_text:
        raise MoestreamError(f"only {len(text)} characters of training text: too little to hold any out")
    train_bpe_tokenizer(train_text.splitlines(keepends=True), vocab_size, tok_dir)
    tok = Tokenizer.load(tok_dir)
    corpus = Corpus(encode(tok, train_text), encode(tok, held_text), len(text.encode("utf-8")))
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"train": corpus.train, "heldout": corpus.heldout, "text_bytes": corpus.text_bytes}, cache)
    return corpus, tok_dir


def encode(tok: Tokenizer, text: str, piece: int = 1 << 20) -> torch.Tensor:
    """Encode in ~1 MiB pieces cut at line ends (the BPE never merges across a newline anyway)."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = text.find("\n", start + piece)
        end = len(text) if end < 0 else end + 1
        ids.extend(tok.encode(text[start:end]))
        start = end
    return torch.tensor(ids, dtype=torch.int32)


def batch(tokens: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
    """[batch_size, seq_len + 1] windows at random offsets; a pure function of (seed, step)."""
    if tokens.numel() <= seq_len + 1:
        raise MoestreamError(f"{tokens.numel()} training tokens are too few for windows of {seq_len + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=g)
    return torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).long()


def heldout_windows(tokens: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping [n, seq_len + 1] windows from the start of the held-out tokens."""
    n = (tokens.numel() - 1) // seq_len
    n = n if limit is None else min(n, limit)
    if n < 1:
        raise MoestreamError(f"{tokens.numel()} held-out tokens are too few for one window of {seq_len + 1}")
    return torch.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]).long()
