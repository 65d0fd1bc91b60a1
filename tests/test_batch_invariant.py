"""Batch invariance (EngineOptions.batch_invariant, kernels/invariant.py): one sequence's logits are bit-identical
whatever other sequences share its steps: how many (row counts across the kernels' thresholds: 1, 2, 3, 8, 16, 17,
64, 65 rows an expert, and dense products of 1 to hundreds of rows), which, decode or mixed with prefill, and a
prompt prefilled beside other prompts or alone. Also the scheduler's fixed prompt pieces, end to end: a seeded
temperature-1 batch job gives identical outputs at any --max-batch."""
from __future__ import annotations

import random

import pytest
import torch

from moestream.batch import BatchOptions, requests_from, run_batch
from moestream.engine.engine import Engine
from moestream.errors import MoestreamError
from moestream.kernels import cpu
from conftest import synth_tiny
from moestream.tokenizer import Tokenizer

from test_batch import essence

pytestmark = pytest.mark.skipif(not cpu.available(), reason="batch invariance needs the native kernels")

# companions decoding beside the target: with the tiny model's 16 experts, top-2, 0..520 companions put about
# 1 to 65 rows on an expert, and 1 to 521 rows through each dense product and the lm_head
COMPANIONS = (0, 1, 2, 3, 7, 8, 15, 16, 17, 63, 64, 65, 130, 255, 520)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth_tiny(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return synth_tiny(tmp_path_factory, "mixtral")


def _trace(eng: Engine, prompt: list[int], companions: int, prefill_beside: int, seed: int) -> list[torch.Tensor]:
    """The target's logits: its prompt prefilled alone, then 4 decode steps beside `companions` decoding sequences
    (random prompts of 1-40 tokens, prefilled together first) and, when `prefill_beside`, a new prompt of that many
    tokens prefilled in the same step (a mixed step)."""
    rng = random.Random(seed)
    v = eng.vocab_size
    target = eng.new_sequence()
    others = [eng.new_sequence() for _ in range(companions)]
    try:
        (logits,) = eng.step([(target, prompt)])
        got = [logits]
        if others:
            eng.step([(s, [rng.randrange(v) for _ in range(rng.randrange(1, 41))]) for s in others])
        for _ in range(4):
            tok = int(torch.argmax(got[-1]))
            items = [(target, [tok])] + [(s, [rng.randrange(v)]) for s in others]
            fresh = eng.new_sequence() if prefill_beside else None
            if fresh is not None:
                items.insert(rng.randrange(len(items) + 1), (fresh, [rng.randrange(v) for _ in range(prefill_beside)]))
            out = eng.step(items)
            got.append(out[[s for s, _ in items].index(target)])
            if fresh is not None:
                eng.free(fresh)
        return got
    finally:
        for s in [target, *others]:
            eng.free(s)


@pytest.mark.parametrize("kv", ["fp32", "int8", "mixtral"])
def test_decode_logits_do_not_depend_on_companions(model, mixtral, kv):
    eng = Engine.open(mixtral if kv == "mixtral" else model, kv_dtype="fp32" if kv == "mixtral" else kv,
                      batch_invariant=True)
    try:
        prompt = random.Random(7).choices(range(eng.vocab_size), k=23)
        alone = _trace(eng, prompt, 0, 0, 0)
        for i, n in enumerate(COMPANIONS[1:]):
            for beside in (0, 1 + 29 * (i % 3)):  # decode only, and mixed with a 1- or 30- or 59-token prefill
                got = _trace(eng, prompt, n, beside, 100 + i)
                assert all(torch.equal(a, b) for a, b in zip(alone, got)), (kv, n, beside)
    finally:
        eng.close()


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_prompt_logits_do_not_depend_on_the_prompts_beside_it(model, kv):
    eng = Engine.open(model, kv_dtype=kv, batch_invariant=True)
    rng = random.Random(3)
    v = eng.vocab_size
    try:
        prompt = [rng.randrange(v) for _ in range(37)]
        s = eng.new_sequence()
        (alone,) = eng.step([(s, prompt)], all_logits=True)
        eng.free(s)
        for n in (1, 2, 5, 17, 40):
            items = [(eng.new_sequence(), [rng.randrange(v) for _ in range(rng.randrange(1, 70))]) for _ in range(n)]
            target = eng.new_sequence()
            items.insert(rng.randrange(n + 1), (target, prompt))
            got = eng.step(items, all_logits=True)[[st for st, _ in items].index(target)]
            assert torch.equal(alone, got), (kv, n)
            for st, _ in items:
                eng.free(st)
    finally:
        eng.close()


def test_invariant_logits_stay_close_to_the_default_path(model):
    """The fixed-order kernels change only the summation order: the same logits within fp32 rounding."""
    prompt = random.Random(5).choices(range(500), k=30)
    got = []
    for on in (False, True):
        eng = Engine.open(model, batch_invariant=on)
        try:
            got.append(eng.logits(prompt))
        finally:
            eng.close()
    assert float((got[0] - got[1]).abs().max() / got[0].abs().max()) < 1e-4


def test_bf16_compute_is_refused(model):
    with pytest.raises(MoestreamError, match="fp32"):
        Engine.open(model, compute_dtype="bf16", batch_invariant=True)


def _sampled_requests(model_name: str, n: int, max_tokens: int) -> list[dict]:
    rng = random.Random(11)
    words = ["tea", "moon", "river", "stone", "cloud", "lamp", "fox", "salt"]
    return [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model_name, "prompt": " ".join(rng.choices(words, k=rng.randrange(2, 30))),
                      "max_tokens": max_tokens, "temperature": 1.0, "seed": 1000 + i, "logprobs": 1}}
            for i in range(n)]


def test_seeded_job_is_identical_at_any_batch_width(model):
    """A seeded temperature-1 job through the Scheduler: one request at a time, 5 and 24 together (prompts cut by
    their own length at a 16-token prefill chunk) give the same outputs, logprobs to the last bit."""
    reqs = _sampled_requests(model.name, 24, 12)
    eng = Engine.open(model, batch_invariant=True)
    try:
        tok = Tokenizer.load(model)
        runs = [run_batch(eng, tok, requests_from(reqs), BatchOptions(max_batch=b, prefill_chunk=16)).results
                for b in (1, 5, 24)]
    finally:
        eng.close()
    def exact(body: dict) -> tuple:  # tokens, and their logprobs to the last bit
        return essence(body), [c["logprobs"]["token_logprobs"] for c in body["choices"]]

    by_id = [{r["custom_id"]: exact(r["response"]["body"]) for r in res} for res in runs]
    assert len(by_id[0]) == 24 and by_id[0] == by_id[1] == by_id[2]


def test_step_charge_is_what_an_invariant_step_charges_itself(model, monkeypatch):
    """What a batch-invariant step charges itself while it runs (the per-slot expert outputs, whole: they are held
    beside every phase's scratch; the fixed-order kernel's input panels beyond the scratch allowance) is what
    `Engine.step_charge` tells the scheduler to make room for. Uncounted, a large prefill step beside a full state
    room raised a BudgetError inside the step, which failed every sequence in it: 400 requests on a small model
    retried 128 of them in 329 steps (104 counted)."""
    from moestream.memory.accountant import MemoryAccountant
    from moestream.engine.engine import plan

    p = plan(model)
    eng = Engine.open(model, ram_budget=p.dense_bytes + p.scratch_bytes + 64 * (1 << 20), batch_invariant=True)
    try:
        st = eng.new_sequence()
        eng.step([(st, [1, 2, 3])])
        peak = [0]
        grow = MemoryAccountant.grow_state

        def watched(self, nbytes, what="sequence state"):
            grow(self, nbytes, what)
            peak[0] = max(peak[0], self.state_bytes)

        monkeypatch.setattr(MemoryAccountant, "grow_state", watched)
        for rows in (10, 700, 1500):
            peak[0] = 0
            eng.step([(st, [5] * rows)])
            held = peak[0] - eng.memory.state_bytes  # charged inside the step and given back at its end
            assert held == eng.step_charge(rows), rows
        # a small step's per-slot outputs fit the allowance but are still charged: the allowance is the phases'
        assert eng.step_charge(10) == 10 * eng.plan.pair_row_bytes > 0
        assert eng.step_charge(1500) > eng.step_charge(700) > eng.step_charge(10)
    finally:
        eng.close()
    plain = Engine.open(model, ram_budget=p.dense_bytes + p.scratch_bytes + 64 * (1 << 20))
    try:
        assert plain.step_charge(1500) == 0
    finally:
        plain.close()
