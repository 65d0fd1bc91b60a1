"""Small byte-level BPE tokenizers for synthetic and demo checkpoints: training on text, and the default corpus.

Owns `train_bpe_tokenizer` (writes tokenizer.json + tokenizer_config.json with a ChatML template) and
`default_training_text` (this Python's standard-library sources, a deterministic offline corpus).
"""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

import tokenizers

from moestream.errors import MoestreamError
from moestream.tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path, chat_template: str | None = None,
                        eos: str = "<|im_end|>") -> None:
    """Train a byte-level BPE and write tokenizer.json + tokenizer_config.json (ChatML template by default)."""
    specials = list(dict.fromkeys([*SPECIAL_TOKENS, eos]))
    if vocab_size < 256 + len(specials):
        raise MoestreamError(f"vocab_size {vocab_size} is too small: use at least 256 byte tokens + "
                             f"{len(specials)} special tokens")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for s in specials}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": eos,
              "added_tokens_decoder": added, "chat_template": chat_template or CHATML_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")


def _python_sources(root: Path) -> Iterator[Path]:
    """Depth-first, name-sorted walk that stops as soon as the caller has enough (no symlinks, no site-packages)."""
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and entry.name not in ("site-packages", "dist-packages"):
            yield from _python_sources(entry)
        elif entry.suffix == ".py" and entry.is_file() and not entry.is_symlink():
            yield entry


def default_training_text(max_bytes: int) -> str:
    """Python standard-library sources, in sorted path order, concatenated up to `max_bytes` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    used = 0
    for path in _python_sources(root) if root.is_dir() else ():
        if used >= max_bytes:
            break
        chunks.append(path.read_bytes()[:max_bytes - used])
        used += len(chunks[-1])
    if max_bytes > 0 and not used:
        raise MoestreamError(f"no Python standard-library sources found under {root}; pass training text explicitly")
    return b"".join(chunks).decode("utf-8", errors="ignore")
