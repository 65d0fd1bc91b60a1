"""The warm one-token step (ExpertRunner.warm / resident_done) when the cache holds what the tokens route to but not
every expert: read-ahead of other experts in flight does not push a step off the native decode layer, and the
lookahead stops running the next layer's router once that layer's steps read nothing (Lookahead.quiet), starting
again when it misses. Counters, not time; the logits stay the same."""
from __future__ import annotations

import pytest
import torch

from conftest import decode_logits, max_rel_diff, prompt_ids
from moestream import Engine
from moestream.experts.prefetch import Lookahead
from moestream.kernels import cpu
from moestream.synth import synthesize

native = pytest.mark.skipif(not cpu.available(), reason=f"no native kernels here ({cpu.reason()})")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("warm") / "m"
    synthesize("qwen3_moe", path, "tiny", progress=False)  # 4 MoE layers of 16 experts, top-2
    return path


def _open(path) -> Engine:
    eng = Engine.open(path, ram_budget="1GB")  # holds every expert: nothing is evicted
    la = eng.runner.lookahead
    la.threshold, la.warmup = 0.0, 0  # the gate open from the first step
    return eng


def _fused(eng: Engine) -> int:
    """Layer steps whose routed experts ran inside the native decode layer."""
    return sum(t.used for t in eng.runner.tables.values() if t is not None)


def _scored(eng: Engine) -> int:
    """Lookahead predictions scored so far (one per predicted layer step)."""
    return sum(g.scored for g in eng.runner.lookahead.gates.values())


@native
def test_read_ahead_in_flight_keeps_the_native_decode_layer(ckpt):
    """Every routed expert cached and the next layer's router stubbed to name one expert no token routes to: that
    expert is read ahead during the pass, and still every layer step of the pass runs its experts inside the native
    decode layer (before, a read in flight sent the steps after it down the general path). Same logits."""
    eng = _open(ckpt)
    runner, la = eng.runner, eng.runner.lookahead
    la.reads, la.quiet = 0, 0  # no read ahead while warming; never skip the router for a quiet layer
    ids = prompt_ids(eng.vocab_size, 6, seed=4)
    decode_logits(eng, ids)  # reads what these tokens route to
    want = decode_logits(eng, ids)  # fills the native layer's tables
    layer = sorted(la.routers)[1]
    unused = [e for e in range(runner.store.num_experts) if (layer, e) not in runner.cache]
    assert unused, "6 tokens x top-2 route to at most 12 of 16 experts"
    la.routers[layer] = lambda x, width=1: torch.full((x.shape[0], 1), unused[0], dtype=torch.long)
    la.reads = 1
    fused0, reads0, resident0 = _fused(eng), runner.times.prefetch_reads, runner.times.resident_steps
    got = decode_logits(eng, ids)
    steps = len(eng.model.layers) * len(ids)
    assert runner.times.prefetch_reads > reads0  # the read ahead happened ...
    assert runner.times.resident_steps - resident0 == steps  # ... and no step took the general path
    assert _fused(eng) - fused0 == steps
    assert torch.equal(got, want)
    runner.finish()  # whatever was not withdrawn lands in the cache, read ahead and unused
    assert not runner._inflight
    assert ((layer, unused[0]) in runner.cache) == ((layer, unused[0]) in runner._fresh)
    eng.close()


def test_quiet_layers_get_no_lookahead_from_warm_steps_until_they_miss(ckpt):
    """The cache holds every expert the tokens route to but not all: once each layer's latest `quiet` steps read
    nothing, warm steps stop running the next layer's router (no prediction scored, nothing read ahead) without
    changing the logits; with quiet=0 they predict on every step. Dropping a layer's experts makes its next step
    miss, and the following tokens predict that layer again."""
    eng = _open(ckpt)
    runner, la = eng.runner, eng.runner.lookahead
    ids = prompt_ids(eng.vocab_size, 6, seed=4)
    for _ in range(3):  # the first pass misses; the next two give every layer 12 steps without a read
        want = decode_logits(eng, ids)
    assert len(runner.cache) < len(la.routers) * runner.store.num_experts  # not every expert cached
    predicted = len(la.routers) - 1  # every MoE layer but the first is predicted from the one before it
    scored0, reads0 = _scored(eng), runner.times.prefetch_reads
    got = decode_logits(eng, ids)
    assert _scored(eng) == scored0 and runner.times.prefetch_reads == reads0
    assert torch.equal(got, want)
    la.quiet = 0
    scored0 = _scored(eng)
    assert torch.equal(decode_logits(eng, ids), want)
    assert _scored(eng) - scored0 == predicted * len(ids)
    la.quiet = Lookahead().quiet  # the default again
    layer = sorted(la.routers)[2]
    for key in [k for k in list(runner.cache.keys()) if k[0] == layer]:
        runner.cache.drop(key)
    gate0 = la.gates[layer].scored
    # (a step reading experts sums them in another order than the grouped warm step: equal up to rounding)
    assert max_rel_diff(decode_logits(eng, ids), want) < 1e-5
    # the first token's step of `layer` read its experts again: the 5 tokens after it predicted the layer
    assert la.gates[layer].scored - gate0 == len(ids) - 1
    eng.close()


def test_a_prompt_step_that_reads_nothing_skips_a_quiet_layers_router(ckpt):
    """A multi-row step (a prefill of the prompt) whose routed experts are all cached takes the general path, and
    follows the warm step's rule: once the next layer's latest `quiet` steps read nothing it runs no lookahead
    router for it (no prediction scored); with quiet=0 it predicts every next layer. Same logits either way."""
    eng = _open(ckpt)
    runner, la = eng.runner, eng.runner.lookahead
    ids = prompt_ids(eng.vocab_size, 3, seed=4)  # 3 x top-2: under half the layer's 16 experts, so no step scans

    def prefill() -> torch.Tensor:
        state = eng.new_sequence()
        try:
            return eng.prefill(state, ids)
        finally:
            eng.free(state)

    want = prefill()  # reads what the prompt routes to
    for _ in range(la.quiet):  # every layer's latest `quiet` steps read nothing
        assert torch.equal(prefill(), want)
    assert len(runner.cache) < len(la.routers) * runner.store.num_experts  # not every expert cached
    resident0, scored0 = runner.times.resident_steps, _scored(eng)
    assert torch.equal(prefill(), want)
    assert runner.times.resident_steps == resident0  # (the general path, not the one-token warm one)
    assert _scored(eng) == scored0
    la.quiet = 0
    assert torch.equal(prefill(), want)
    assert _scored(eng) - scored0 == len(la.routers) - 1  # every MoE layer but the first, once
    la.quiet = Lookahead().quiet
    eng.close()
