"""Synthetic checkpoints: transformers loads them and agrees with moestream; index, shards, config and tokenizer
are what a real Hugging Face checkpoint of the family would hold."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import max_rel_diff, prompt_ids, reference_logits
from moestream import Engine
from moestream.errors import MoestreamError
from moestream.synth import PRESETS, synth_family, synthesize
from moestream.tokenizer import Tokenizer

FAMILIES = ["qwen3_moe", "mixtral", "kimi_linear"]
FP32 = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")  # fp32 in real checkpoints


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, cache_dir):
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = tmp_path_factory.mktemp("synth") / family
            synthesize(family, made[family], "tiny", seed=0, cache_dir=cache_dir, progress=False)
        return made[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_and_agrees(tiny, family):
    from transformers import AutoModelForCausalLM

    if family == "kimi_linear" and importlib.util.find_spec("fla") is not None:
        pytest.skip("the transformers reference must run its torch (non-fla) KDA path")
    path = tiny(family)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompt_ids(PRESETS["tiny"].vocab, 40)
    want = reference_logits(ref, ids)
    got = Engine.open(path).logits(ids)
    assert max_rel_diff(got, want) < 1e-3
    assert 0.3 < float(want.std()) < 3.0, "output scale should be about unit"


@pytest.mark.parametrize("family", FAMILIES)
def test_config_is_what_transformers_writes(tiny, family, tmp_path):
    from transformers import AutoConfig

    path = tiny(family)
    AutoConfig.from_pretrained(path).save_pretrained(tmp_path)
    assert json.loads((path / "config.json").read_text()) == json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_index_and_shards_are_consistent(tiny, family):
    path = tiny(family)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) >= 3
    assert {p.name for p in shards} == set(index["weight_map"].values())
    seen, total = {}, 0
    for shard in shards:
        with safe_open(shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                t = f.get_slice(name)
                assert t.get_dtype() == ("F32" if name.endswith(FP32) else "BF16"), name
                seen[name] = shard.name
                total += torch.Size(t.get_shape()).numel() * (4 if t.get_dtype() == "F32" else 2)
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_tokenizer_and_special_ids(tiny):
    path = tiny("qwen3_moe")
    tok = Tokenizer.load(path)
    cfg = json.loads((path / "config.json").read_text())
    assert tok.vocab_size <= cfg["vocab_size"]
    assert tok.token_to_id("<|im_end|>") == cfg["eos_token_id"] in tok.eos_token_ids
    assert tok.token_to_id("<|endoftext|>") == cfg["bos_token_id"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


def test_tokenizer_is_trained_once_per_vocab(tiny, cache_dir, tmp_path):
    tiny("qwen3_moe")
    trained = list((cache_dir / "tokenizers").iterdir())
    assert len(trained) == 1
    stamp = (trained[0] / "tokenizer.json").stat().st_mtime_ns
    synthesize("mixtral", tmp_path / "again", "tiny", cache_dir=cache_dir, progress=False)
    assert list((cache_dir / "tokenizers").iterdir()) == trained
    assert (trained[0] / "tokenizer.json").stat().st_mtime_ns == stamp


def test_routing_is_not_degenerate(tiny):
    eng = Engine.open(tiny("qwen3_moe"))
    eng.logits(prompt_ids(PRESETS["tiny"].vocab, 75))
    touched = eng.stats["expert_misses"]  # without a budget, each distinct (layer, expert) misses exactly once
    p = PRESETS["tiny"]
    assert touched >= 0.75 * p.layers * p.experts


def test_seed_reproducible(tmp_path, cache_dir):
    a, b, c = (tmp_path / n for n in "abc")
    for d, seed in ((a, 1), (b, 1), (c, 2)):
        synthesize("mixtral", d, "tiny", seed=seed, cache_dir=cache_dir, progress=False)
    first = "model-00001-of-00004.safetensors"
    assert (a / first).read_bytes() == (b / first).read_bytes()
    assert (a / first).read_bytes() != (c / first).read_bytes()


def test_family_names_and_errors(tmp_path, cache_dir):
    assert synth_family("qwen3-moe").model_type == synth_family("qwen3_moe").model_type == "qwen3_moe"
    with pytest.raises(MoestreamError, match="mixtral"):
        synth_family("llama")
    with pytest.raises(MoestreamError, match="preset"):
        synthesize("mixtral", tmp_path / "x", "huge", cache_dir=cache_dir)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(MoestreamError, match="not empty"):
        synthesize("mixtral", tmp_path / "full", "tiny", cache_dir=cache_dir, progress=False)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"], "no partial directory is left behind"


def test_layer_and_vocab_overrides(tmp_path, cache_dir):
    """`synth --layers N --vocab V` changes only those two sizes; a bad value is an error, not a checkpoint."""
    synthesize("qwen3_moe", tmp_path / "m", "tiny", layers=2, vocab=640, cache_dir=cache_dir, progress=False)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["vocab_size"]) == (2, 640)
    assert cfg["hidden_size"] == PRESETS["tiny"].hidden
    with pytest.raises(MoestreamError, match="--layers"):
        synthesize("qwen3_moe", tmp_path / "bad", "tiny", layers=0, cache_dir=cache_dir, progress=False)
