"""config.json that lacks a key or carries a wrong value: every family's parse answers with a CheckpointError
naming the key (`moestream info` prints `error: ...` and exits 2), never a KeyError / TypeError traceback; rope
types outside the supported set are a clear error, and llama3 rope matches transformers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moestream.cli import main
from moestream.engine.engine import plan
from moestream.errors import CheckpointError, MoestreamError, UnsupportedModelError
from moestream.models.rope import build_rope


def _synth_config(family: str) -> dict:
    from moestream.synth.families import SpecialIds, preset, synth_family

    return synth_family(family).config(preset("tiny"), SpecialIds(1, 2, 0))


def _hf_config(module: str) -> dict:
    import importlib

    return importlib.import_module(module).tiny_config().to_dict()


def _k25() -> dict:
    return {"model_type": "kimi_k25", "text_config": {**_hf_config("test_deepseek_v3"), "model_type": "kimi_k2"}}


CONFIGS = {
    "qwen3_moe": lambda: _synth_config("qwen3_moe"),
    "mixtral": lambda: _synth_config("mixtral"),
    "kimi_linear": lambda: _synth_config("kimi_linear"),
    "kimi_k3": lambda: _synth_config("kimi_k3"),
    "deepseek_v3": lambda: _hf_config("test_deepseek_v3"),
    "gpt_oss": lambda: _hf_config("test_gpt_oss"),
    "kimi_k25": _k25,
}
# keys each family cannot do without (the text config's, for the multimodal ones)
REQUIRED = {
    "qwen3_moe": ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_experts_per_tok", "vocab_size"],
    "mixtral": ["num_hidden_layers", "num_local_experts", "num_experts_per_tok", "vocab_size"],
    "kimi_linear": ["num_hidden_layers", "vocab_size", "num_attention_heads"],
    "kimi_k3": ["linear_attn_config", "num_hidden_layers", "hidden_size", "attn_res_block_size", "num_experts"],
    "deepseek_v3": ["num_hidden_layers", "hidden_size", "moe_intermediate_size", "num_experts_per_tok"],
    "gpt_oss": ["num_hidden_layers", "num_local_experts", "num_experts_per_tok", "vocab_size"],
    "kimi_k25": ["num_hidden_layers", "hidden_size", "moe_intermediate_size"],
}


def _text(c: dict) -> dict:
    return c["text_config"] if isinstance(c.get("text_config"), dict) else c


def _plan_config(tmp_path: Path, c: dict):
    d = tmp_path / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(c))
    return plan(d)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_missing_required_key_is_named(tmp_path, family):
    for key in REQUIRED[family]:
        c = CONFIGS[family]()
        c_text = _text(c)
        assert key in c_text or key in c, key
        c_text.pop(key, None)
        c.pop(key, None) if c is not c_text else None
        with pytest.raises(CheckpointError, match=repr(key).replace("[", r"\[")):
            _plan_config(tmp_path, c)


def _replacements(v):
    if isinstance(v, bool):
        return ["yes", 3]
    if isinstance(v, int):
        return [str(v), -v if v else -1, float(v) + 0.5, [v], 10**40]
    if isinstance(v, float):
        return [str(v), [v], -abs(v) - 1.0]
    if isinstance(v, (list, dict)):
        return ["x", 7]
    return [123, [v]]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_field_of_a_wrong_type_is_a_clear_error(tmp_path, family):
    """Each field of the text config swapped for wrong types: parsing ends in a MoestreamError or succeeds, never
    anything else (success is fine for fields the family ignores)."""
    base = CONFIGS[family]()
    for key, value in _text(base).items():
        if key == "model_type":
            continue
        for bad in _replacements(value):
            c = json.loads(json.dumps(base))
            _text(c)[key] = bad
            try:
                _plan_config(tmp_path, c)
            except MoestreamError:
                pass


@pytest.mark.parametrize("key,bad", [("num_hidden_layers", "2"), ("hidden_size", -64), ("vocab_size", 1.5),
                                     ("num_experts_per_tok", 99), ("num_attention_heads", 5),
                                     ("tie_word_embeddings", "false"), ("rms_norm_eps", 0)])
def test_wrong_values_name_the_key(tmp_path, key, bad):
    c = CONFIGS["qwen3_moe"]()
    c[key] = bad
    with pytest.raises(CheckpointError, match=key if key != "num_experts_per_tok" else "exceeds"):
        _plan_config(tmp_path, c)


def test_cli_info_missing_key_exits_2_without_traceback(tmp_path, capsys):
    c = CONFIGS["mixtral"]()
    del c["num_local_experts"]
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(c))
    assert main(["info", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "num_local_experts" in err and "Traceback" not in err


# ---- rope ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dynamic", "longrope", "su"])
def test_unsupported_rope_type_is_named_with_the_supported_ones(kind):
    cfg = {"rope_scaling": {"rope_type": kind, "factor": 2.0}, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError) as e:
        build_rope(cfg, 16)
    assert kind in str(e.value) and "llama3" in str(e.value) and "yarn" in str(e.value)


def test_rope_parameter_missing_is_named():
    with pytest.raises(CheckpointError, match="low_freq_factor"):
        build_rope({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}}, 16)


@pytest.mark.parametrize("dim,theta,factor,low,high,orig", [(64, 500000.0, 8.0, 1.0, 4.0, 8192),
                                                           (16, 10000.0, 4.0, 1.0, 4.0, 64),
                                                           (128, 500000.0, 32.0, 1.0, 4.0, 8192)])
def test_llama3_rope_matches_transformers(dim, theta, factor, low, high, orig):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
              "original_max_position_embeddings": orig, "rope_theta": theta}
    hf = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim, rope_parameters=dict(params),
                     max_position_embeddings=orig * int(factor))
    want, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    rope = build_rope({"rope_parameters": params}, dim)
    assert rope.attention_factor == attention_factor == 1.0
    torch.testing.assert_close(rope.inv_freq, want.float(), rtol=1e-6, atol=0)
    # long wavelengths are divided by the factor, short ones kept
    assert math.isclose(float(rope.inv_freq[-1]), float(want[-1]), rel_tol=1e-6)
    assert float(rope.inv_freq[0]) == pytest.approx(1.0)


# ---- config.json that disagrees with the tensors ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> dict[str, Path]:
    from conftest import synth_tiny

    return {"qwen3_moe": synth_tiny(tmp_path_factory, "qwen3_moe"),
            "kimi_linear": synth_tiny(tmp_path_factory, "kimi_linear")}


@pytest.mark.parametrize("family,path,value,message", [
    ("qwen3_moe", ("head_dim",), 32, "do not fit its config.json"),
    ("qwen3_moe", ("num_key_value_heads",), 1, "do not fit its config.json"),
    ("qwen3_moe", ("vocab_size",), 100_000, "vocab_size"),
    ("qwen3_moe", ("num_experts",), 3, "experts, one row each"),
    ("kimi_linear", ("linear_attn_config", "short_conv_kernel_size"), 1, "conv kernel"),
])
def test_config_that_does_not_fit_the_tensors_is_a_checkpoint_error(tiny_pair, tmp_path, family, path, value,
                                                                    message):
    import shutil

    from moestream import Engine

    d = Path(shutil.copytree(tiny_pair[family], tmp_path / "ckpt"))
    c = json.loads((d / "config.json").read_text())
    node = c
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=message):
        eng = Engine.open(d)
        eng.generate([1, 2, 3], 2, stop_token_ids=[])
