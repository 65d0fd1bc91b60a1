"""A wide step's last-row logits come a chunk at a time (engine.StepLogits): a step of more than LOGIT_CHUNK_ROWS
sequences holds LOGIT_CHUNK_ROWS rows of [V] logits while its caller samples them in order, not one a sequence
(with Kimi K3's 160k vocabulary a 1,000-sequence step's whole [B, V] is 655 MB). Checked: the values against each
sequence stepped alone, how many chunks reading in order and out of order make, the scheduler's charge, and a
streamed lm_head left whole."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import max_rel_diff, synth_tiny
from moestream.engine import engine as engine_mod
from moestream.engine.engine import LOGIT_CHUNK_ROWS, Engine, StepLogits
from moestream.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth_tiny(tmp_path_factory, "qwen3_moe")


def _prompts(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 9))] for _ in range(n)]


def test_wide_step_logits_come_a_chunk_at_a_time_with_each_sequences_values(model):
    eng = Engine.open(model, threads=1)
    try:
        n = 2 * LOGIT_CHUNK_ROWS + 7
        prompts = _prompts(eng.vocab_size, n)
        states = [eng.new_sequence() for _ in range(n)]
        out = eng.step(list(zip(states, prompts)))
        assert isinstance(out, StepLogits) and len(out) == n
        assert out.chunks == 0  # nothing made before it is read
        got = [row.clone() for row in out]
        assert out.chunks == 3  # in order: each chunk once
        out[0], out[n - 1], out[1]
        assert out.chunks == 6  # back and forth: a chunk is made again after another was made
        assert out[-1].equal(got[-1])
        with pytest.raises(IndexError):
            out[n]
        for s in states:
            eng.free(s)
        for i in (0, LOGIT_CHUNK_ROWS - 1, LOGIT_CHUNK_ROWS, n - 1):  # each alone: the plain [1, V] path
            s = eng.new_sequence()
            (alone,) = eng.step([(s, prompts[i])])
            eng.free(s)
            assert not isinstance(alone, StepLogits) and alone.shape == got[i].shape
            assert max_rel_diff(got[i], alone) < 1e-4, i
    finally:
        eng.close()


def test_a_step_up_to_the_chunk_and_all_logits_steps_are_whole(model):
    eng = Engine.open(model, threads=1)
    try:
        prompts = _prompts(eng.vocab_size, LOGIT_CHUNK_ROWS + 1)
        states = [eng.new_sequence() for _ in prompts]
        assert isinstance(eng.step(list(zip(states[:LOGIT_CHUNK_ROWS], prompts))), list)
        every = eng.step(list(zip(states, prompts)), all_logits=True)
        assert isinstance(every, list) and [r.shape[0] for r in every] == [len(p) for p in prompts]
        assert eng.logit_rows(1000) == LOGIT_CHUNK_ROWS and eng.logit_rows(10) == 10
        assert eng.logit_rows(1000, all_logits=True) == 1000
    finally:
        eng.close()


def test_a_streamed_head_is_not_chunked(model, monkeypatch):
    eng = Engine.open(model, threads=1)
    try:
        monkeypatch.setattr(type(eng.model), "head_resident", property(lambda self: False))
        assert eng.logit_rows(500) == 500  # the scheduler charges every row
        prompts = _prompts(eng.vocab_size, LOGIT_CHUNK_ROWS + 3)
        out = eng.step([(eng.new_sequence(), p) for p in prompts])
        assert isinstance(out, list) and len(out) == len(prompts)
    finally:
        eng.close()


def test_scheduler_charges_one_chunk_of_logits_while_it_samples(model, monkeypatch):
    """A batch job whose decode steps run 65+ sequences: the logits charge the scheduler holds is LOGIT_CHUNK_ROWS
    rows (what StepLogits holds), never one a sequence."""
    from moestream.batch import BatchOptions, requests_from, run_batch

    seen = []
    real = engine_mod.StepLogits.__getitem__

    def spy(self, i):
        row = real(self, i)
        seen.append(self.chunks)
        return row
    monkeypatch.setattr(engine_mod.StepLogits, "__getitem__", spy)
    charged = []
    real_act = Engine.activation_bytes

    def act(self, rows, logit_rows, prompt_rows=0):
        charged.append(logit_rows)
        return real_act(self, rows, logit_rows, prompt_rows)
    monkeypatch.setattr(Engine, "activation_bytes", act)
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model.name, "prompt": [3 + i % 50, 7], "max_tokens": 24, "temperature": 0}}
             for i in range(150)]
    eng = Engine.open(model, threads=1)
    try:
        results = run_batch(eng, Tokenizer.load(model), requests_from(lines), BatchOptions(max_batch=150)).results
    finally:
        eng.close()
    assert len(results) == 150 and all(r["error"] is None for r in results)
    assert seen and max(seen) >= 2  # decode steps of 65+ sequences read their logits in two chunks or more
    assert max(charged) == LOGIT_CHUNK_ROWS  # never 150 rows of logits charged
