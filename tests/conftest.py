"""Shared test helpers: tiny transformers reference models saved to a temp dir, and parity checks."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


class FakeWeights:
    """A dict of tensors standing in for DenseWeights, to build one mixer without a checkpoint."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        from moestream.memory.accountant import MemoryAccountant

        self.t, self.memory = tensors, MemoryAccountant(None)

    def __contains__(self, name: str) -> bool:
        return name in self.t

    def get(self, name: str) -> torch.Tensor:
        return self.t[name]

    def maybe(self, name: str):
        return self.t.get(name)


def save_reference(model_cls, config, path, seed: int = 0):
    """Build a tiny random transformers model in fp32, save it with save_pretrained, return it in eval mode."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    return model


def synth_tiny(tmp_path_factory, family: str, name: str = "tiny"):
    """A tiny random-weight checkpoint of `family` (moestream.synth) in a fresh temp dir; returns its path."""
    from moestream.synth import synthesize

    root = tmp_path_factory.mktemp(f"synth_{family.replace('-', '_')}")
    synthesize(family, root / name, "tiny", cache_dir=root / "cache", progress=False)
    return root / name


def smaps_mappings() -> list[dict]:
    """This process's mappings from /proc/self/smaps: start, end, each "kB" field in bytes, and VmFlags as `flags`."""
    out = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                a, b = (int(x, 16) for x in head[0].split("-"))
                out.append({"start": a, "end": b})
            elif out and line.endswith("kB\n"):
                out[-1][head[0].rstrip(":")] = int(head[1]) * 1024
            elif out and head and head[0] == "VmFlags:":
                out[-1]["flags"] = head[1:]
    return out


def prompt_ids(vocab: int, n: int = 75, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def decode_logits(eng, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), V] from a fresh sequence fed one token per engine step (the decode path), freed after."""
    state = eng.new_sequence()
    try:
        return torch.stack([eng.step([(state, [t])])[0] for t in ids])
    finally:
        eng.free(state)


def gqa_block_weights(h: int, d: int) -> dict[str, torch.Tensor]:
    """Random bf16 q/k/v/o of a GQA layer (4 query heads, 2 KV heads of width d, hidden h) and unit norms: the
    operands of a small fused.DecodeBlock."""
    w = {n: torch.randn(*s).bfloat16() for n, s in (("q", (4 * d, h)), ("k", (2 * d, h)), ("v", (2 * d, h)),
                                                       ("o", (h, 4 * d)))}
    w.update(in_norm=torch.ones(h), post_norm=torch.ones(h))
    return w


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the 'relative logit difference' reported in issue notes."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        x = torch.tensor([ids])
        # explicit mask: without it transformers masks every prompt token equal to pad_token_id
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def group_on_and_off(open_engine, vocab: int, calls: list, decline, n_prompt: int, n_batched: int):
    """The grouped-expert check: (warm prompt logits, a two-sequence step's logits, 12 greedy ids) from an engine
    whose runner takes the family's grouped call (its native calls appended to `calls`), then again after
    `decline()` makes the group decline (every expert one by one): asserts both give the same bits and that the
    second run made no grouped call."""
    a, b = prompt_ids(vocab, n_prompt, seed=3), prompt_ids(vocab, 9, seed=4)

    def run():
        eng = open_engine()
        eng.logits(a[:20])  # the experts read: later steps' experts are resident (the grouped call's)
        warm = eng.logits(a)
        sa, sb = eng.new_sequence(), eng.new_sequence()
        both = eng.step([(sa, a[:n_batched]), (sb, b)])
        return warm, both, eng.generate(b, 12, stop_token_ids=[])

    grouped = run()
    assert calls and max(calls) > 2
    n = len(calls)
    decline()
    alone = run()
    assert len(calls) == n  # the declining group: every expert went one by one
    assert torch.equal(grouped[0], alone[0])
    assert all(torch.equal(x, y) for x, y in zip(grouped[1], alone[1]))
    assert grouped[2] == alone[2]


def expert_budget(path, fraction: float = 0.3) -> int:
    """A RAM budget holding the dense weights, scratch and `fraction` of the experts (forces evictions)."""
    from moestream.engine.engine import plan

    p = plan(path)
    return p.dense_bytes + p.scratch_bytes + max(p.max_expert_bytes * 2, int(p.expert_bytes * fraction))


def model_type_of(path) -> str:
    import json
    from pathlib import Path

    return json.loads((Path(path) / "config.json").read_text()).get("model_type", "?")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def threads():
    """Yields cpu.set_threads (the native kernels' threads per call); the count is restored after the test."""
    from moestream.kernels import cpu

    before = cpu.threads()
    yield cpu.set_threads
    cpu.set_threads(before)


@pytest.fixture
def one_thread():
    """One torch thread for a test: on two shared cores torch's threaded ops stall under load, and tiny tensors
    gain nothing from threads. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def check_parity():
    """check_parity(path, ref_model, vocab) -> dict of figures; asserts logits 1e-3, 32 greedy tokens, budget."""
    from moestream import Engine

    def run(path, ref, vocab: int, n_prompt: int = 75, n_gen: int = 32, tol: float = 1e-3, fraction=0.3):
        ids = prompt_ids(vocab, n_prompt)
        budget = expert_budget(path, fraction) + n_prompt * vocab * 4  # + the all-position logits (charged)
        eng = Engine.open(path, ram_budget=budget)
        got = eng.logits(ids)
        want = reference_logits(ref, ids)
        rel = max_rel_diff(got, want)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert rel < tol, f"max relative logit difference {rel:.2e} >= {tol}"
        greedy = eng.generate(ids, n_gen, stop_token_ids=[])
        ref_greedy = reference_greedy(ref, ids, n_gen)
        assert greedy == ref_greedy
        s = eng.stats
        assert s["expert_evictions"] > 0, "budget was meant to force evictions"
        assert s["peak_resident_bytes"] <= budget
        # shown with `pytest -s`: the figures the issue notes quote
        print(f"\nPARITY {model_type_of(path)}: max relative logit diff {rel:.2e}, {n_gen} greedy tokens identical, "
              f"{s['expert_evictions']} evictions, peak {s['peak_resident_bytes']} <= budget {budget}")
        return {"max_rel_logit_diff": rel, "greedy_identical": greedy == ref_greedy, "stats": s}

    return run
