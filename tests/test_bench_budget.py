"""`moestream bench` and `Engine.open` agree on what budget is enough: bench keeps room for its own sequence's state
(prompt + generated tokens, as `moestream plan` sizes it), so a budget the engine opens under runs the benchmark,
and one that cannot hold the state is refused up front, naming the state room. The benchmark decodes by the native
one-token layer the unwrapped model takes, its phase clock notwithstanding."""
from __future__ import annotations

import pytest

from moestream.bench import BenchOptions, bench, bench_state_room
from moestream.engine.engine import plan
from moestream.engine.residency import plan_residency
from moestream.errors import BudgetError

PROMPT, GEN = 40, 6


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    from conftest import synth_tiny

    return synth_tiny(tmp_path_factory, "kimi_k3")


def _floor(path, room: int) -> int:
    p = plan(path)
    try:
        return plan_residency(p, None, room).min_ram_budget
    finally:
        p.store.close()


def test_state_room_covers_the_sequence_the_engine_accounts(k3):
    from moestream import Engine

    room = bench_state_room(k3, BenchOptions(ram_budget=1 << 40, prompt_len=PROMPT, gen_len=GEN))
    assert room is not None and room > 0
    eng = Engine.open(k3, threads=1)
    try:
        s = eng.new_sequence()
        tok = int(eng.prefill(s, list(range(3, 3 + PROMPT))).argmax())
        for _ in range(GEN):
            (logits,) = eng.step([(s, [tok])])
            tok = int(logits.argmax())
        assert 0 < eng.memory.state_bytes <= room
    finally:
        eng.close()
    # given explicitly (or without a budget) the option is taken as is
    assert bench_state_room(k3, BenchOptions(ram_budget=1 << 40, state_room=0)) == 0
    assert bench_state_room(k3, BenchOptions(ram_budget=None)) is None


def test_smallest_budget_with_state_room_runs_and_one_byte_less_is_refused_up_front(k3):
    opts = dict(prompt_len=PROMPT, gen_len=GEN, probe=False, threads=1, temperature=1.0)
    room = bench_state_room(k3, BenchOptions(ram_budget=1 << 40, **opts))
    floor = _floor(k3, room)
    assert floor > _floor(k3, 0)  # the engine's own default (no state room) opens below it
    # the plan's floor counts stored tensors; the family derives a few KB more, which the engine's check after the
    # build counts: a budget within that margin is refused there, with the state room named, never mid-run
    budget = floor + (64 << 10)
    r = bench(k3, BenchOptions(ram_budget=budget, **opts))
    assert len(r["per_token"]) == GEN and r["peak_accounted_bytes"] <= budget
    for short in (floor - 1, floor + 1):
        try:
            bench(k3, BenchOptions(ram_budget=short, **opts))
        except BudgetError as e:
            assert "state room" in str(e)
        else:
            assert short > floor  # only a budget at or above the floor may run


def test_phase_clock_keeps_the_native_decode_layer(tmp_path_factory):
    from conftest import synth_tiny

    from moestream import Engine
    from moestream.bench import PhaseClock

    path = synth_tiny(tmp_path_factory, "qwen3_moe")
    eng = Engine.open(path, threads=1)
    try:
        mixers = [layer.mixer for layer in eng.model.layers]
        if not all(hasattr(m, "decode_block") for m in mixers):
            pytest.skip("this family has no native one-token layer")
        clock = PhaseClock()
        assert clock.wrap(eng.model)
        s = eng.new_sequence()
        tok = int(eng.prefill(s, [5, 6, 7, 8]).argmax())
        before = sum(m.decode_blocks for m in mixers)
        for _ in range(3):
            (logits,) = eng.step([(s, [tok])])
            tok = int(logits.argmax())
        plan = eng.model._all_layers
        clock.unwrap()
        assert sum(m.decode_blocks for m in mixers) > before  # the wrapped model still took the native layer
        assert plan and plan[2].runs > 0  # ... in native runs of every layer (decode_layers)
        assert clock.mixer_s > 0
        assert all(layer.mixer is m for layer, m in zip(eng.model.layers, mixers))
        assert "decode_layers" not in vars(eng.model)
    finally:
        eng.close()


def test_phase_clock_leaves_the_runners_time_out_of_the_layers_runs():
    """A native run of the layers (decode_layers) that stops at a missing expert sends that layer's experts through
    the runner, whose reads, experts and lookahead the benchmark counts in their own phases: the mixer's time
    leaves them out, so the phases add up to the step."""
    import time
    from types import SimpleNamespace

    from moestream.bench import PhaseClock

    times = SimpleNamespace(io_wait_s=0.0, expert_s=0.0, lookahead_s=0.0)

    class Model:
        layers = [SimpleNamespace(mixer=lambda *a: None)]

        def decode_layers(self, h, batch):
            time.sleep(0.01)  # the native run
            t = time.perf_counter()
            time.sleep(0.05)  # a layer's experts through the runner
            times.expert_s += time.perf_counter() - t

    model, clock = Model(), PhaseClock()
    assert clock.wrap(model, SimpleNamespace(times=times))
    model.decode_layers(None, None)
    clock.unwrap()
    assert 0.009 < clock.mixer_s < 0.04 and times.expert_s >= 0.05
    assert "decode_layers" not in vars(model)
