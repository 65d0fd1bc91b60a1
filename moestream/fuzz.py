"""Checkpoint mutations for robustness checks: a tiny checkpoint's files damaged at random, then opened through
the real code paths (tests/test_fuzz_checkpoints.py with hypothesis, bench/fuzz_checkpoints.py at scale).

Owns the mutators (JSON value swaps, deletions and type changes, huge numbers; byte flips; truncation) of
safetensors headers, config.json, tokenizer files, the shard index and pack manifests, and `exercise(dir)`: the
`info` command, Engine.open, a few generated tokens, the tokenizer and chat template, and pack verification. Any
exception other than a MoestreamError escaping `exercise` is a finding.
"""
from __future__ import annotations

import contextlib
import io
import json
import random
import struct
from pathlib import Path
from typing import Any

JUNK: list[Any] = [None, True, False, 0, 1, -1, 2, 3, -2**63, 2**63, 2**64 + 1, 10**30, -10**30, 0.5, -0.0, 1e308,
                   float("nan"), float("inf"), "", "x", "64", "../../outside", "/dev/zero", "\u0000", [], [1, 2],
                   [-1], {}, {"a": 1}, [[[]]], "BF16", "U8", {"rope_type": "dynamic"}]
TARGETS = ("header", "config", "tokenizer", "tokenizer_config", "index", "manifest")


def _paths(tree: Any, at: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys / indices) into a JSON tree, the root included."""
    out = [at]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, at + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree[:64]):  # long lists (vocabularies, merges): their head is enough
            out += _paths(v, at + (i,))
    return out


def _near(v: Any, rng: random.Random) -> Any:
    """A value of v's own type that is likely wrong: a sign flip, off by one, scaled, huge, empty."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return rng.choice([-v, v + 1, v - 1, v * 2, v // 2, 0, v * 10**12, 2**62])
    if isinstance(v, float):
        return rng.choice([-v, v * 1e6, 0.0, v + 0.5])
    if isinstance(v, str):
        return rng.choice(["", v[::-1], v + v, v.upper(), v[: len(v) // 2]])
    if isinstance(v, list):
        return rng.choice([[], v[:-1], v + v[-1:], list(reversed(v))])
    if isinstance(v, dict):
        return rng.choice([{}, dict(list(v.items())[:-1])])
    return rng.choice(JUNK)


def mutate_json(tree: Any, rng: random.Random) -> Any:
    """One random edit of a JSON tree: replace a node by junk or a near miss, delete it, or swap two nodes."""
    paths = _paths(tree)
    path = rng.choice(paths)
    op = rng.choice(["junk", "near", "near", "delete", "swap"])
    if not path:
        return rng.choice(JUNK) if op == "junk" else _near(tree, rng)
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if op == "delete":
        del parent[key]
    elif op == "swap":
        other = rng.choice(paths)
        value = tree
        for k in other:
            value = value[k]
        parent[key] = json.loads(json.dumps(value))
    else:
        parent[key] = rng.choice(JUNK) if op == "junk" else _near(parent[key], rng)
    return tree


def mutate_bytes(data: bytes, rng: random.Random, lo: int = 0, hi: int | None = None) -> bytes:
    """Flip a few bytes in [lo, hi), truncate, or insert junk bytes."""
    hi = len(data) if hi is None else min(hi, len(data))
    if hi <= lo:
        return data[: rng.randrange(len(data) + 1)]
    op = rng.choice(["flip", "flip", "truncate", "insert"])
    buf = bytearray(data)
    if op == "flip":
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(lo, hi)] = rng.randrange(256)
    elif op == "truncate":
        del buf[rng.randrange(lo, hi):]
    else:
        at = rng.randrange(lo, hi)
        buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return bytes(buf)


def _parsed(raw: bytes) -> Any:
    """The JSON in `raw`, or a sentinel when an earlier edit already broke it (then bytes are mutated instead)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return _BROKEN


_BROKEN = object()


def _mutate_json_file(path: Path, rng: random.Random) -> str:
    raw = path.read_bytes()
    tree = _parsed(raw)
    if tree is _BROKEN or rng.random() < 0.25:
        path.write_bytes(mutate_bytes(raw, rng))
        return f"{path.name}: bytes"
    path.write_text(json.dumps(mutate_json(tree, rng)))
    return f"{path.name}: json"


def _mutate_header(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    hlen = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 0
    header = _parsed(data[8:8 + hlen]) if 8 + hlen <= len(data) else _BROKEN
    roll = rng.random()
    if roll < 0.6 and header is not _BROKEN:
        header = mutate_json(header, rng)
        body = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + hlen:])
        return f"{path.name}: header json"
    if roll < 0.75:
        n = rng.choice([0, 1, hlen - 1, hlen + 1, len(data), 2**64 - 1, rng.randrange(2**40)])
        path.write_bytes(struct.pack("<Q", n) + data[8:])
        return f"{path.name}: header length {n}"
    path.write_bytes(mutate_bytes(data, rng, 0, min(len(data), 8 + hlen + (64 if roll > 0.9 else 0))))
    return f"{path.name}: header bytes"


def mutate(root: Path, rng: random.Random, target: str | None = None) -> str:
    """Damage one file of the checkpoint at `root` in place; returns what was done."""
    files = {
        "header": sorted(p for p in root.glob("*.safetensors") if p.is_file()),
        "config": [root / "config.json"],
        "tokenizer": [root / "tokenizer.json"],
        "tokenizer_config": [root / "tokenizer_config.json"],
        "index": [root / "model.safetensors.index.json"],
        "manifest": [root / "moestream-pack.json"],
    }
    choices = [t for t in TARGETS if any(p.is_file() for p in files[t])]
    target = target if target in choices else rng.choice(choices)
    path = rng.choice([p for p in files[target] if p.is_file()])
    if target == "header":
        return _mutate_header(path, rng)
    return _mutate_json_file(path, rng)


def exercise(root: Path, tokens: int = 3) -> None:
    """Use the checkpoint the way a user would: `moestream info`, open, tokenize, chat template, generate a few
    tokens, decode, and `pack --verify` for packed ones. Raises what the code raises."""
    from moestream import Engine
    from moestream.cli import main
    from moestream.tokenizer import Tokenizer
    from moestream.weights.index import PACK_MANIFEST
    from moestream.pack import verify_pack

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(["info", str(root)])  # a MoestreamError is printed as `error: ...` and returns 2
    if (root / PACK_MANIFEST).exists():
        verify_pack(root)
    tok = Tokenizer.load(root)
    ids = tok.encode("def add(a, b):\n    return a + b") or [0]
    if tok.has_chat_template:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    eng = Engine.open(root)
    try:
        out = eng.generate(ids, tokens, stop_token_ids=[])
        tok.decode(out)
    finally:
        eng.close()
