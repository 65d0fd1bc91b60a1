"""Core engine tests on tiny transformers checkpoints: parity, sharded and fused layouts, prefill vs decode,
batching, the RAM budget, corrupt checkpoints, request validation, sampling and stop tokens."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import decode_logits, max_rel_diff, prompt_ids, reference_logits, save_reference
from moestream import Engine
from moestream.engine.engine import plan
from moestream.errors import BudgetError, CheckpointError, RequestError, UnsupportedModelError

VOCAB = 256


def _common() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_experts_per_tok=2, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)


def qwen3_config():
    from transformers import Qwen3MoeConfig

    # layer 1 is a dense MLP (mlp_only_layers), so the MoE / dense switch is exercised too
    return Qwen3MoeConfig(**_common(), intermediate_size=96, moe_intermediate_size=64, num_experts=16,
                          norm_topk_prob=False, mlp_only_layers=[1])


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(**_common(), intermediate_size=64, num_local_experts=16)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("qwen3_moe")
    return path, save_reference(Qwen3MoeForCausalLM, qwen3_config(), path)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from transformers import MixtralForCausalLM

    path = tmp_path_factory.mktemp("mixtral")
    return path, save_reference(MixtralForCausalLM, mixtral_config(), path)


@pytest.fixture(scope="module")
def sharded(qwen, tmp_path_factory):
    """The qwen3 reference saved again with small shards (so there is a model.safetensors.index.json)."""
    path = tmp_path_factory.mktemp("qwen3_sharded")
    qwen[1].save_pretrained(path, max_shard_size="200KB")
    return path


# ---- parity ------------------------------------------------------------------------------------------------------
def test_qwen3_moe_parity(qwen, check_parity):
    check_parity(qwen[0], qwen[1], VOCAB)


def test_mixtral_parity(mixtral, check_parity):
    check_parity(mixtral[0], mixtral[1], VOCAB)


def test_sharded_and_fused_layouts_agree(qwen, sharded, tmp_path):
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) >= 3
    fused = tmp_path / "fused"
    _write_fused(qwen[0], fused)
    ids = prompt_ids(VOCAB, 40)
    want = reference_logits(qwen[1], ids)
    for path in (qwen[0], sharded, fused):
        eng = Engine.open(path, ram_budget=_budget(path, 4, _kv_bytes(path, ids)))
        assert max_rel_diff(eng.logits(ids), want) < 1e-3, path.name
        assert eng.stats["expert_evictions"] > 0
    assert plan(fused).layout.parts[0].fused


def _write_fused(src: Path, dst: Path) -> None:
    """Rewrite per-expert tensors as HF-internal fused ones: gate_up_proj [E, 2I, H] (gate rows first) and
    down_proj [E, H, I] per layer."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    n_exp = cfg.get("num_experts", cfg.get("num_local_experts"))
    for layer in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{layer}.mlp.experts."
        if base + "0.gate_proj.weight" not in tensors:
            continue
        pop = lambda e, n: tensors.pop(f"{base}{e}.{n}_proj.weight")  # noqa: E731
        gate_up = [torch.cat([pop(e, "gate"), pop(e, "up")]) for e in range(n_exp)]
        tensors[base + "gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]
        tensors[base + "down_proj"] = torch.stack([pop(e, "down") for e in range(n_exp)])  # [E, H, I]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def _kv_bytes(path: Path, ids: list[int]) -> int:
    """State bytes a sequence of `ids` holds (the KV cache grows in chunks, so this covers a few more tokens)."""
    eng = Engine.open(path)
    state = eng.new_sequence()
    eng.prefill(state, ids)
    return eng.memory.state_bytes


def _budget(path: Path, n_experts: int, state_bytes: int = 0) -> int:
    p = plan(path)
    return p.dense_bytes + p.scratch_bytes + state_bytes + n_experts * p.max_expert_bytes


# ---- prefill, decode, batching -------------------------------------------------------------------------------
def test_prefill_equals_token_by_token_decode(qwen):
    eng = Engine.open(qwen[0])
    ids = prompt_ids(VOCAB, 24)
    full = eng.logits(ids)
    steps = decode_logits(eng, ids)
    assert max_rel_diff(steps, full) < 1e-5


def test_read_completion_order_does_not_change_logits(tmp_path, monkeypatch):
    """Reads that finish in reverse order give bit-identical logits: experts are combined in a fixed order
    (top-4, so a row sums enough terms for the order to show in fp32)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from transformers import MixtralForCausalLM

    from conftest import expert_budget
    from moestream.experts.store import ExpertStore

    cfg = mixtral_config()
    cfg.num_experts_per_tok = 4
    save_reference(MixtralForCausalLM, cfg, tmp_path)

    ids = prompt_ids(VOCAB, 24, seed=7)

    def run() -> torch.Tensor:
        eng = Engine.open(tmp_path, ram_budget=expert_budget(tmp_path, 0.3))
        try:
            out = torch.stack([eng.logits(ids[:n])[-1] for n in (8, 16, 24)])
            assert eng.stats["expert_misses"] > 30
            return out
        finally:
            eng.close()

    in_order = run()
    submit, delay = ExpertStore.submit, ThreadPoolExecutor(16)

    def reversed_landing(self, layer, e, priority=0):  # low expert ids land last
        inner = submit(self, layer, e, priority)
        return delay.submit(lambda: (time.sleep(0.002 * (16 - e)), inner.result())[1])

    monkeypatch.setattr(ExpertStore, "submit", reversed_landing)
    assert torch.equal(run(), in_order)
    delay.shutdown()


def test_two_sequences_in_one_step_equal_each_alone(mixtral):
    eng = Engine.open(mixtral[0])
    a_ids, b_ids = prompt_ids(VOCAB, 20, seed=3), prompt_ids(VOCAB, 13, seed=4)
    a, b = eng.new_sequence(), eng.new_sequence()
    got_a, got_b = eng.step([(a, a_ids), (b, b_ids)], all_logits=True)
    next_a, next_b = eng.step([(a, [5]), (b, [7])])
    for ids, got, nxt, tok in ((a_ids, got_a, next_a, 5), (b_ids, got_b, next_b, 7)):
        alone = eng.logits(ids + [tok])
        assert max_rel_diff(got, alone[:-1]) < 1e-5
        assert max_rel_diff(nxt, alone[-1]) < 1e-5


def test_budget_of_two_experts_is_never_exceeded(qwen):
    ids = prompt_ids(VOCAB, 30)
    want = Engine.open(qwen[0]).generate(ids, 64, stop_token_ids=[])
    budget = _budget(qwen[0], 2, _kv_bytes(qwen[0], ids + want))  # KV for the 30 + 64 tokens
    eng = Engine.open(qwen[0], ram_budget=budget)
    assert eng.generate(ids, 64, stop_token_ids=[]) == want
    s = eng.stats
    assert s["peak_resident_bytes"] <= budget
    assert s["expert_evictions"] > 0 and s["cache_bytes"] <= 2 * plan(qwen[0]).max_expert_bytes


def test_budget_below_dense_weights_fails_at_open(qwen):
    dense = plan(qwen[0]).dense_bytes
    with pytest.raises(BudgetError) as e:
        Engine.open(qwen[0], ram_budget=dense - 1)
    assert str(dense) in str(e.value) and str(dense - 1) in str(e.value)


# ---- broken checkpoints --------------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _last_shard(path: Path) -> Path:
    return sorted(path.glob("*.safetensors"))[-1]


def test_truncated_shard(sharded, tmp_path):
    path = _copy(sharded, tmp_path / "ckpt")
    shard = _last_shard(path)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        Engine.open(path)


def test_tensor_data_shorter_than_header_says(sharded, tmp_path):
    path = _copy(sharded, tmp_path / "ckpt")
    shard = _last_shard(path)
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=shard.name):
        Engine.open(path)


@pytest.mark.parametrize("damage", ["length", "json", "offsets"])
def test_corrupt_header(sharded, tmp_path, damage):
    path = _copy(sharded, tmp_path / "ckpt")
    shard = _last_shard(path)
    data = bytearray(shard.read_bytes())
    (hlen,) = struct.unpack("<Q", data[:8])
    if damage == "length":
        data[:8] = b"\xff" * 8
    elif damage == "json":
        data[8:24] = b"\x00garbage{{{\xfe\xfe\xfe\xfe"
    else:  # a tensor's byte range disagrees with its dtype and shape
        header = json.loads(data[8:8 + hlen])
        name = next(k for k in header if k != "__metadata__")
        header[name]["shape"] = [s + 1 for s in header[name]["shape"]]
        text = json.dumps(header, separators=(",", ":")).encode().ljust(hlen)
        assert len(text) == hlen
        data[8:8 + hlen] = text
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        Engine.open(path)


def test_unknown_model_type(sharded, tmp_path):
    path = _copy(sharded, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(UnsupportedModelError) as e:
        Engine.open(path)
    assert "llama" in str(e.value) and "qwen3_moe" in str(e.value) and "mixtral" in str(e.value)


# ---- requests, sampling, stopping ----------------------------------------------------------------------------
def test_out_of_range_token_ids(mixtral):
    eng = Engine.open(mixtral[0])
    for bad in ([0, VOCAB], [-1, 3]):
        with pytest.raises(RequestError):
            eng.logits(bad)
        with pytest.raises(RequestError):
            eng.generate(bad, 4)
    with pytest.raises(RequestError):
        eng.logits([])
    with pytest.raises(RequestError):
        eng.generate([1, 2], 4, temperature=-1.0)


def test_seeded_sampling(mixtral):
    eng = Engine.open(mixtral[0])
    ids = prompt_ids(VOCAB, 10)
    run = lambda seed: eng.generate(ids, 16, temperature=1.0, top_p=0.95, seed=seed, stop_token_ids=[])  # noqa
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    """engine.sampling.draw: one uniform draw a token, inverted through the running sum of the probabilities."""
    from moestream.engine.sampling import SamplingParams, draw, sample

    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    gen = torch.Generator().manual_seed(3)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(n)]), minlength=5)
    assert counts[1] == 0 and counts[4] == 0
    assert float((counts.double() / n - probs.double()).abs().max()) < 0.015  # 4 sd at p = 0.5
    assert draw(torch.tensor([0.0, 0.0, 7.0, 0.0]), gen) == 2  # unnormalised, one token possible
    same = [draw(probs, torch.Generator().manual_seed(9)) for _ in range(4)]
    assert len(set(same)) == 1
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])  # top_p 0.7 keeps the two likeliest only
    picks = {sample(logits, SamplingParams(1.0, 0.7), gen) for _ in range(300)}
    assert picks == {0, 1}


def test_stop_tokens_stop(mixtral):
    eng = Engine.open(mixtral[0])
    ids = prompt_ids(VOCAB, 10)
    greedy = eng.generate(ids, 24, stop_token_ids=[])
    stop = greedy[6]
    assert eng.generate(ids, 24, stop_token_ids=[stop]) == greedy[:greedy.index(stop)]
    assert eng.generate(ids, 0) == []
    assert eng.eos_token_ids == [2]
    default = eng.generate(ids, 24)  # stops at the config's eos (2) if it comes up
    assert default == (greedy[:greedy.index(2)] if 2 in greedy else greedy)
