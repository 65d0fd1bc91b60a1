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

FAMILIES = ["qwen3_moe", "mixtral", "kimi_linear"]  # transformers writes these configs itself
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


# ---- DeepSeek-V3 (block-FP8, published layout) and the full-width preset ----------------------------------------
def _dequantised_reference(path: Path, out: Path):
    """DeepseekV3ForCausalLM loaded by transformers from the checkpoint's dequantised values (experts fused the way
    transformers stores them): the independent reference for the FP8 synth."""
    from transformers import DeepseekV3ForCausalLM

    from moestream.kernels.quant import dequant_fp8_block, dequant_int4_packed

    cfg = json.loads((path / "config.json").read_text())
    block = tuple(cfg.pop("quantization_config").get("weight_block_size") or (0, 0))
    cfg["model_type"] = "deepseek_v3"  # Kimi K2's model class is DeepSeek-V3's
    raw = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})
    plain = {k: (dequant_fp8_block(t, raw[k + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn
                 else t.float()) for k, t in raw.items() if not k.endswith(("_scale_inv", "weight_packed",
                                                                            "weight_scale", "weight_shape"))}
    for k in [k for k in raw if k.endswith(".weight_packed")]:  # Kimi K2's int4 experts
        stem = k[:-len("packed")]
        plain[stem[:-1]] = dequant_int4_packed(raw[k], raw[stem + "scale"], 32, raw[stem + "shape"].tolist())
    for i in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        n = cfg["n_routed_experts"]
        plain[p + "gate_up_proj"] = torch.stack([torch.cat([plain.pop(f"{p}{e}.gate_proj.weight"),
                                                            plain.pop(f"{p}{e}.up_proj.weight")]) for e in range(n)])
        plain[p + "down_proj"] = torch.stack([plain.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    out.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in plain.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def test_deepseek_v3_layout_is_published(tiny):
    path = tiny("deepseek_v3")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [32, 32]}
    dtypes = {}
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            dtypes.update({k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()})
    assert dtypes["model.layers.1.mlp.experts.3.up_proj.weight"] == ("F8_E4M3", (64, 64))
    assert dtypes["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"] == ("F32", (2, 2))
    assert dtypes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == ("F32", (1, 2))  # 24 rows: ragged
    assert dtypes["model.layers.0.mlp.down_proj.weight"][0] == "F8_E4M3"
    assert dtypes["model.layers.1.mlp.gate.weight"][0] == "BF16"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"
    assert {dtypes[k][0] for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")} == {"BF16"}


def test_kimi_k2_layout_is_published(tiny):
    """Kimi K2 Thinking's layout: int4 pack-quantized routed experts (int32 words, a bf16 scale per 32 inputs, the
    int32 [out, in] shape), every other linear bf16, the published compressed-tensors config."""
    path = tiny("kimi_k2")
    cfg = json.loads((path / "config.json").read_text())
    q = cfg["quantization_config"]
    assert (cfg["model_type"], q["quant_method"], q["format"]) == ("kimi_k2", "compressed-tensors", "pack-quantized")
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32 and "re:.*self_attn.*" in q["ignore"]
    t = _tensors(path)
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    p = "model.layers.1.mlp.experts.3.down_proj."
    assert (t[p + "weight_packed"].dtype, tuple(t[p + "weight_packed"].shape)) == (torch.int32, (h, i // 8))
    assert (t[p + "weight_scale"].dtype, tuple(t[p + "weight_scale"].shape)) == (torch.bfloat16, (h, i // 32))
    assert t[p + "weight_shape"].tolist() == [h, i]
    assert t["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.0.self_attn.o_proj.weight"].dtype == t["model.layers.0.mlp.up_proj.weight"].dtype \
        == torch.bfloat16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2"])
def test_deepseek_v3_agrees_with_transformers_on_dequantised_weights(tiny, tmp_path, family):
    path = tiny(family)
    ref = _dequantised_reference(path, tmp_path / "reference")
    ids = prompt_ids(PRESETS["tiny"].vocab, 40)
    want = reference_logits(ref, ids)
    assert max_rel_diff(Engine.open(path).logits(ids), want) < 1e-3
    assert 0.3 < float(want.std()) < 3.0, "output scale should be about unit"


# ---- gpt-oss (MXFP4 experts, published layout) --------------------------------------------------------------
def _tensors(path: Path) -> dict[str, torch.Tensor]:
    raw = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})
    return raw


def test_gpt_oss_layout_is_published(tiny):
    path = tiny("gpt_oss")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    t = _tensors(path)
    e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    p = "model.layers.1.mlp.experts."
    assert (t[p + "gate_up_proj_blocks"].dtype, t[p + "gate_up_proj_blocks"].shape) == (torch.uint8,
                                                                                        (e, 2 * i, h // 32, 16))
    assert t[p + "gate_up_proj_scales"].shape == (e, 2 * i, h // 32)
    assert (t[p + "down_proj_blocks"].shape, t[p + "down_proj_scales"].shape) == ((e, h, i // 32, 16), (e, h, i // 32))
    assert t[p + "down_proj_bias"].dtype == t["model.layers.1.self_attn.sinks"].dtype == torch.bfloat16
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]


def test_gpt_oss_agrees_with_transformers_on_dequantised_experts(tiny, tmp_path):
    """GptOssForCausalLM built from the synth's config (minus quantization) and its tensors with every MXFP4 expert
    dequantised and transposed to transformers' fused [E, in, out]: the independent reference."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from moestream.kernels.quant import dequant_mxfp4

    path = tiny("gpt_oss")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("quantization_config")
    raw = _tensors(path)
    plain = {k: v.float() for k, v in raw.items() if not k.endswith(("_blocks", "_scales"))}
    for k in [k for k in raw if k.endswith("_blocks")]:
        base = k[:-len("_blocks")]
        blocks, scales = raw[k], raw[base + "_scales"]
        plain[base] = torch.stack([dequant_mxfp4(b.reshape(b.shape[0], -1), s).T for b, s in zip(blocks, scales)])
    ref = GptOssForCausalLM(GptOssConfig(**cfg)).eval()
    ref.load_state_dict(plain, strict=True)
    ids = prompt_ids(PRESETS["tiny"].vocab, 40)
    want = reference_logits(ref, ids)
    assert max_rel_diff(Engine.open(path).logits(ids), want) < 1e-3
    assert 0.3 < float(want.std()) < 3.0, "output scale should be about unit"


def test_large_tensors_are_written_in_row_blocks(tmp_path, cache_dir, monkeypatch):
    """With tiny chunks every 2-D tensor is made and written block by block, fused expert tensors a few experts at a
    time; the files stay valid safetensors and FP8 tiles keep whole 128-row blocks, so the models still run to
    finite logits."""
    import moestream.synth.stream as stream

    monkeypatch.setattr(stream, "CHUNK_ELEMENTS", 1024)
    synthesize("deepseek_v3", tmp_path / "m", "tiny", cache_dir=cache_dir, progress=False)
    assert stream.chunk_rows(stream.TensorSpec("w", (512, 64), "proj")) == 128
    fused = stream.TensorSpec("b", (128, 64, 2, 16), "proj")  # gpt-oss's [E, out, in/32, 16]: no 128-row rule
    assert stream.chunk_rows(fused) == 1
    synthesize("gpt_oss", tmp_path / "oss", "tiny", cache_dir=cache_dir, progress=False)  # fused experts in pieces
    assert torch.isfinite(Engine.open(tmp_path / "oss").logits(prompt_ids(PRESETS["tiny"].vocab, 20))).all()
    logits = Engine.open(tmp_path / "m").logits(prompt_ids(PRESETS["tiny"].vocab, 20))
    assert torch.isfinite(logits).all()


def test_full_width_sizes_are_the_published_shapes():
    from moestream.synth import full_width_sizes

    k3 = full_width_sizes("kimi_k3", 2, vocab=32768)
    assert k3["moe"] == [False, True]
    expert = 17_547_264  # one K3 expert's six MXFP4 tensors (spec: kimi-k3.md section 3)
    assert 896 * expert < k3["layers"][1] < 896 * expert + 2**30  # + MLA, shared expert, latent projections
    v3 = full_width_sizes("deepseek_v3", 4)
    assert v3["moe"] == [False, False, False, True]  # first_k_dense_replace 3 kept when the layers allow it
    v3_expert = 3 * (2048 * 7168 + 16 * 56 * 4)  # e4m3 codes + fp32 scale_inv per 128 x 128 tile
    assert 256 * v3_expert < v3["layers"][3] < 257 * v3_expert + 300 * 2**20
    assert v3["other"] > 2 * 129280 * 7168 * 2  # bf16 embeddings and lm_head at the published vocabulary
    k2 = full_width_sizes("kimi_k2", 4)
    assert k2["moe"] == [False, True, True, True]  # first_k_dense_replace 1
    k2_expert = 3 * (2048 * 7168 // 2 + 2048 * 7168 // 32 * 2 + 8)  # int4 words + bf16 group scales + the shape
    assert 384 * k2_expert < k2["layers"][1] < 384 * k2_expert + 400 * 2**20  # + bf16 MLA and shared expert
    assert k2["other"] == 2 * 163840 * 7168 * 2 + 7168 * 2  # bf16 embeddings, lm_head, final norm
    oss = full_width_sizes("gpt_oss", 2)
    assert oss["moe"] == [True, True]  # gpt-oss has no dense layer
    oss_expert = 3 * 2880 * 2880 // 2 + 3 * 2880 * 90 + 3 * 2880 * 2  # E2M1 codes + E8M0 scales + bf16 biases
    assert 128 * oss_expert < oss["layers"][0] < 128 * oss_expert + 60 * 2**20  # + bf16 attention (~53 MiB)


def test_full_width_needs_layers_and_a_family_that_has_it(tmp_path, cache_dir):
    with pytest.raises(MoestreamError, match="needs --layers"):
        synthesize("deepseek_v3", tmp_path / "a", "full-width", cache_dir=cache_dir, progress=False)
    with pytest.raises(MoestreamError, match="not available for qwen3_moe"):
        synthesize("qwen3_moe", tmp_path / "b", "full-width", layers=2, cache_dir=cache_dir, progress=False)
    assert not any(tmp_path.iterdir())


def test_synth_help_sizes_are_true():
    """The disk sizes `synth --help` prints are the inventory's (GiB, two decimals)."""
    from moestream.cli.synth import FULL_WIDTH_SIZES
    from moestream.synth import full_width_sizes

    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB"

    for family, layers in (("kimi_k3", 2), ("deepseek_v3", 2), ("kimi_k2", 2), ("gpt_oss", 2)):
        full, small = full_width_sizes(family, layers), full_width_sizes(family, layers, 32768)
        for figure in (full["layers"][0], full["layers"][1], full["other"], small["other"], full["total"],
                       small["total"]):
            assert gib(figure) in FULL_WIDTH_SIZES, (family, gib(figure))
    kda = full_width_sizes("kimi_k3", 5)  # 0-based 0-2 use KDA mixers
    assert gib(kda["layers"][0]) in FULL_WIDTH_SIZES and gib(kda["layers"][1]) in FULL_WIDTH_SIZES
