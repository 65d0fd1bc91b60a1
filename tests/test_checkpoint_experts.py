"""Malformed experts and tokenizer tables: one expert with another shape is refused at open (the native grouped
MXFP4 path sizes every expert from one), the grouped call re-checks its operands, and a huge added-token id is an
error instead of an enormous table."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from conftest import synth_tiny
from moestream import Engine
from moestream.errors import CheckpointError, TokenizerError
from moestream.models.latent_moe import make_act, mxfp4_group
from moestream.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def k3(tmp_path_factory) -> Path:
    return synth_tiny(tmp_path_factory, "kimi-k3")


def _reshape_in_header(path: Path, name: str) -> None:
    """Give tensor `name` the shape [rows / 2, cols * 2]: the same bytes, so the header stays self-consistent."""
    for shard in path.glob("*.safetensors"):
        data = shard.read_bytes()
        (hlen,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + hlen])
        if name in header:
            rows, cols = header[name]["shape"]
            header[name]["shape"] = [rows // 2, cols * 2]
            body = json.dumps(header).encode()
            shard.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + hlen:])
            return
    raise AssertionError(f"{name} not found")


def test_one_malformed_expert_is_refused_at_open(k3, tmp_path):
    path = Path(shutil.copytree(k3, tmp_path / "ckpt"))
    cfg = json.loads((path / "config.json").read_text())["text_config"]
    layer = cfg["first_k_dense_replace"]
    _reshape_in_header(path, f"language_model.model.layers.{layer}.block_sparse_moe.experts.3.w1.weight_packed")
    with pytest.raises(CheckpointError) as e:
        Engine.open(path)
    assert f"layer {layer} expert 3" in str(e.value) and "w1_packed" in str(e.value)


def _mxfp4_expert(inter: int, latent: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def codes(rows: int, cols: int) -> torch.Tensor:
        return torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)

    def scales(rows: int, cols: int) -> torch.Tensor:
        return torch.full((rows, cols // 32), 120, dtype=torch.uint8)

    return {"w1_packed": codes(inter, latent), "w1_scale": scales(inter, latent),
            "w3_packed": codes(inter, latent), "w3_scale": scales(inter, latent),
            "w2_packed": codes(latent, inter), "w2_scale": scales(latent, inter)}


@pytest.mark.parametrize("bad", ["first", "later", "width"])
def test_grouped_mxfp4_checks_every_expert_before_the_kernel(bad):
    gen = torch.Generator().manual_seed(0)
    inter, latent = 64, 64
    tensors = [_mxfp4_expert(inter, latent, gen) for _ in range(3)]
    z = torch.randn(4, latent)
    if bad == "width":
        z = torch.randn(4, latent * 2)
    else:
        tensors[0 if bad == "first" else 2] = _mxfp4_expert(inter * 2, latent, gen)
    ids = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1]])
    weights = torch.full((4, 2), 0.5)
    out = torch.zeros_like(z)
    with pytest.raises(CheckpointError, match="MXFP4 expert part"):
        mxfp4_group(make_act(4.0, 25.0))(z, ids, weights, [0, 1, 2], tensors, out)


def _kimi_dir(path: Path, added: dict, vocab: int | None = None) -> None:
    import base64

    path.mkdir()
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    (path / "config.json").write_text(json.dumps({} if vocab is None else {"vocab_size": vocab}))


@pytest.mark.parametrize("vocab", [None, 1024])
def test_huge_added_token_id_is_an_error_not_a_huge_table(tmp_path, vocab):
    _kimi_dir(tmp_path / "kimi", {"5000000": {"content": "<|far|>", "special": True}}, vocab)
    with pytest.raises(TokenizerError, match="5000000"):
        Tokenizer.load(tmp_path / "kimi")


def test_added_tokens_within_the_vocab_still_load(tmp_path):
    _kimi_dir(tmp_path / "kimi", {"300": {"content": "<|a|>", "special": True}}, 1024)
    tok = Tokenizer.load(tmp_path / "kimi")
    assert tok.token_to_id("<|a|>") == 300 and tok.vocab_size == 512


@pytest.mark.parametrize("decoder", [["x"], {"²": {"content": "<|sq|>"}}])
def test_malformed_added_tokens_decoder(tmp_path, decoder):
    _kimi_dir(tmp_path / "kimi", decoder)
    with pytest.raises(TokenizerError, match="added_tokens_decoder"):
        Tokenizer.load(tmp_path / "kimi")
