"""The one-call layer for a short prompt chunk (fused.DecodeBlock.rows / ms_gqa_rows_block, GQAMixer.rows_block,
Layer._rows, ExpertRunner.rows_done): the same logits bit for bit as the separate native calls and the runner's
general step it replaces (norms, q/k/v, attention with the KV append, o_proj, residual, router, grouped experts),
over chunks of 2-16 tokens across a KV block boundary, with 1 and 2 threads; the runner's books (hits per layer,
counters, quiet counts, lookahead scores, the policy's victims in order) as the general step leaves them; longer
chunks and the bf16 compute path's products left to the general path; bad operands get clear errors."""
from __future__ import annotations

import pytest
import torch

from conftest import gqa_block_weights, prompt_ids
from moestream import Engine
from moestream.kernels import cpu, fused
from moestream.memory.state import BLOCK_TOKENS
from moestream.models.attention import GQAMixer
from moestream.synth import synthesize

native = pytest.mark.skipif(not cpu.available(), reason=f"no native kernels here ({cpu.reason()})")

ORIG = GQAMixer.rows_block
MODES = {"off": lambda *a, **k: None,  # the general path
         "attention": lambda self, *a, **k: ORIG(self, *a[:6]),  # the attention half and router only (no table)
         "whole": ORIG}


@pytest.fixture
def threads():
    before = cpu.threads()
    yield cpu.set_threads
    cpu.set_threads(before)


def _chunks(vocab: int) -> list[list[int]]:
    ids = prompt_ids(vocab, BLOCK_TOKENS + 6, seed=3)
    # 5, 16, a decode token, 16, 2, 17 (past the native kernels: general path), then 3 across the block boundary
    cuts = [0, 5, 21, 22, 38, 40, 57, BLOCK_TOKENS - 1, BLOCK_TOKENS + 2]
    return [ids[a:b] for a, b in zip(cuts, cuts[1:])]


def _feed(eng: Engine, chunks: list[list[int]], mode: str, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(GQAMixer, "rows_block", MODES[mode])
        state = eng.new_sequence()
        try:
            return torch.stack([eng.step([(state, c)])[0] for c in chunks])
        finally:
            eng.free(state)


def _warm(eng: Engine, chunks: list[list[int]], monkeypatch) -> None:
    """Every expert cached and used (in its layer's table) by the general path, with no read-ahead in flight and
    none landing later: the runner's state then does not depend on the reader's timing."""
    eng.runner.lookahead.enabled = False
    _feed(eng, [prompt_ids(eng.vocab_size, 300, seed=11)], "off", monkeypatch)
    _feed(eng, chunks, "off", monkeypatch)
    eng.runner.lookahead.enabled = True
    assert len(eng.runner.cache) == len(eng.runner.lookahead.routers) * eng.runner.store.num_experts
    assert not eng.runner._inflight


def _books(eng: Engine) -> tuple:
    r, stats = eng.runner, eng.runner.cache.stats
    return (stats.hits, stats.misses, dict(stats.layer_hits), r.times.steps, dict(r._quiet),
            {k: (g.scored, g.recall) for k, g in r.lookahead.gates.items()}, list(r.cache.policy.victims()))


def _used(eng: Engine) -> int:
    return sum(t.used for t in eng.runner.tables.values() if t is not None)


@native
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_rows_block_equals_the_general_path_and_keeps_the_books(family, n_threads, tmp_path, monkeypatch, threads):
    synthesize(family, tmp_path / family, "tiny", progress=False)
    threads(n_threads)
    got = {}
    for mode in MODES:
        eng = Engine.open(tmp_path / family, ram_budget="1GB")
        chunks = _chunks(eng.vocab_size)
        _warm(eng, chunks, monkeypatch)
        layers = eng.model.layers
        rows0, used0 = sum(ly.mixer.row_blocks for ly in layers), _used(eng)
        logits = _feed(eng, chunks, mode, monkeypatch)
        short = sum(1 < len(c) <= 16 for c in chunks)
        assert sum(ly.mixer.row_blocks for ly in layers) - rows0 == (0 if mode == "off" else short * len(layers))
        got[mode] = (logits, _books(eng), _used(eng) - used0)
    assert torch.equal(got["attention"][0], got["off"][0])
    assert torch.equal(got["whole"][0], got["off"][0])
    assert got["attention"][1] == got["off"][1]
    assert got["whole"][1] == got["off"][1]
    # the decode token's layers ran from the tables in every mode; the whole blocks ran chunks' experts too
    assert got["attention"][2] == got["off"][2] == len(layers)
    assert got["whole"][2] >= 2 * len(layers)


@native
def test_bf16_compute_leaves_its_products_to_the_general_path(tmp_path, monkeypatch):
    """Under compute_dtype bf16 a chunk of 16 rows (whose products take the bf16 kernels) runs the general path;
    a shorter one (fp32 products on either path) takes the block, with the same logits."""
    synthesize("qwen3_moe", tmp_path / "m", "tiny", progress=False)
    got = []
    for mode in ("whole", "off"):
        eng = Engine.open(tmp_path / "m", ram_budget="1GB", compute_dtype="bf16")
        ids = prompt_ids(eng.vocab_size, 21, seed=4)
        chunks = [ids[:16], ids[16:]]
        _warm(eng, chunks, monkeypatch)
        rows0 = sum(ly.mixer.row_blocks for ly in eng.model.layers)
        got.append(_feed(eng, chunks, mode, monkeypatch))
        assert sum(ly.mixer.row_blocks for ly in eng.model.layers) - rows0 == \
            (len(eng.model.layers) if mode == "whole" else 0)
    assert torch.equal(got[0], got[1])


@native
def test_rows_block_rejects_bad_operands():
    h, d = 32, 8
    w = gqa_block_weights(h, d)
    block = fused.DecodeBlock(w, 4, 2, d, 1e-6, 1.0, 0.3, None, BLOCK_TOKENS)
    keys, values = [torch.zeros(BLOCK_TOKENS, 2, d)], [torch.zeros(BLOCK_TOKENS, 2, d)]
    with pytest.raises(ValueError, match="fp32 h"):
        block.rows(torch.randn(3, h + 1), keys, values, 0, 3)
    with pytest.raises(ValueError, match="fp32 h"):
        block.rows(torch.randn(3, h).double(), keys, values, 0, 3)
    with pytest.raises(ValueError, match="bad cache rows"):
        block.rows(torch.randn(3, h), keys, values, 0, 2)  # fewer rows than new tokens
    with pytest.raises(ValueError, match="bad cache rows"):
        block.rows(torch.randn(3, h), keys, values, 1, 4)  # the cache lacks a key the first token sees
    out, x2, ids, wts, done = block.rows(torch.randn(3, h), keys, values, 0, 3)
    assert out.shape == x2.shape == (3, h) and ids is None and wts is None and not done
    assert torch.isfinite(out).all() and keys[0][:3].abs().sum() > 0 and keys[0][3:].abs().sum() == 0
