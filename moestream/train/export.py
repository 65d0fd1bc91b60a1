"""Export the trained demo model as an official-layout Kimi K3 checkpoint, and load such a checkpoint back.

Owns the mapping between the training module's state dict and the checkpoint: the tensor list, shapes and
dtypes come from moestream.models.kimi_k3's inventory (so a mismatch is an error, not a silent divergence),
routed experts are split per expert and packed as compressed-tensors MXFP4 (`weight_packed` / `weight_scale`),
the rest bf16 or fp32 as in the published checkpoint. Loading back dequantises exactly (for held-out checks).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from moestream.errors import CheckpointError
from moestream.kernels.quant import dequant_mxfp4, quantize_mxfp4
from moestream.models.kimi_k3 import PREFIX, KimiK3Config, expert_tensors, layer_dense_tensors, top_tensors
from moestream.synth.families import SpecialIds
from moestream.synth.kimi_k3 import K3Dims, k3_config
from moestream.synth.writer import ShardWriter, special_ids, write_json
from moestream.train.model import DemoConfig, DemoK3
from moestream.weights.index import CheckpointIndex

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EXPERT_PARTS = ("w1", "w2", "w3")


def dims(cfg: DemoConfig) -> K3Dims:
    return K3Dims(cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.attn_res_block_size, cfg.intermediate_size,
                  cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.latent_size, cfg.num_shared_experts,
                  cfg.mla_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                  cfg.v_head_dim, cfg.kda_heads, cfg.kda_head_dim)


def config_from_checkpoint(raw: dict) -> DemoConfig:
    """The training config of a K3 checkpoint's config.json (top level or text_config)."""
    c = KimiK3Config.from_hf(raw)
    if c.mla_layers != DemoConfig(num_layers=c.num_layers).mla_layers or c.first_dense != 1:
        raise CheckpointError("only checkpoints with K3's layer pattern (MLA every 4th and last two, layer 0 "
                              "dense) load into the training model")
    return DemoConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_layers,
        intermediate_size=c.intermediate_size, num_experts=c.num_experts, top_k=c.top_k,
        moe_intermediate_size=c.moe_intermediate_size, latent_size=c.latent, num_shared_experts=c.num_shared,
        attn_res_block_size=c.block, kda_heads=c.kda_heads, kda_head_dim=c.kda_dim, conv_kernel=c.conv_size,
        mla_heads=c.heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.nope_dim,
        qk_rope_head_dim=c.rope_dim, v_head_dim=c.v_dim, rms_norm_eps=c.eps, gate_lower_bound=c.gate_lower_bound,
        situ_beta=c.situ_beta, situ_linear_beta=c.situ_linear_beta, routed_scaling_factor=c.scaling)


def _expert_key(name: str) -> tuple[str, int, str] | None:
    """'model.layers.3.block_sparse_moe.experts.7.w2.weight_packed' -> (stacked param name, 7, 'packed')."""
    if ".block_sparse_moe.experts." not in name:
        return None
    head, tail = name.split(".block_sparse_moe.experts.")
    e, w, kind = tail.split(".", 2)
    return f"{head}.block_sparse_moe.experts.{w}", int(e), kind.replace("weight_", "").replace("weight", "full")


def inventory(k3: KimiK3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every language-model tensor in checkpoint order: embeddings, each layer (dense, then experts), head."""
    top = top_tensors(k3)
    inv = {"model.embed_tokens.weight": top["model.embed_tokens.weight"]}
    for layer in range(k3.num_layers):
        inv.update(layer_dense_tensors(k3, layer))
        for e in range(k3.num_experts) if layer in k3.moe_layers else ():
            inv.update(expert_tensors(k3, layer, e))
    inv.update({k: v for k, v in top.items() if k not in inv})
    return inv


def checkpoint_tensors(model: DemoK3, quantize: bool = True):
    """Yield (name without prefix, tensor in the checkpoint's dtype) for the whole inventory, checking shapes."""
    raw = k3_config(dims(model.cfg), SpecialIds(0, 0))
    if not quantize:
        raw.pop("quantization_config")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    packed: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (shape, dtype) in inventory(KimiK3Config.from_hf(raw)).items():
        key = _expert_key(name)
        if key is None:
            t = state[name]
        elif key[2] == "full":
            t = state[key[0]][key[1]]
        else:
            if (key[0], key[1]) not in packed:
                packed = {(key[0], key[1]): quantize_mxfp4(state[key[0]][key[1]].float())}
            t = packed[(key[0], key[1])][0 if key[2] == "packed" else 1]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{name}: training shape {list(t.shape)} but the K3 inventory says {list(shape)}")
        yield name, t.to(DTYPES[dtype]).contiguous()


def export_checkpoint(model: DemoK3, tokenizer_dir: Path, out_dir: Path, quantize: bool = True,
                      shard_bytes: int = 16 << 20, extra: dict | None = None) -> dict:
    """Write config.json, shards + index, tokenizer files, generation_config.json and training.json."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / f, out_dir / f)
    ids = special_ids(Path(tokenizer_dir))
    config = k3_config(dims(model.cfg), ids)
    if not quantize:
        config.pop("quantization_config")
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", {"bos_token_id": ids.bos, "eos_token_id": ids.eos})
    writer = ShardWriter(out_dir, shard_bytes)
    for name, t in checkpoint_tensors(model, quantize):
        writer.add(PREFIX + name, t)
    shards = writer.finish()
    for f in out_dir.iterdir():  # safetensors writes owner-only files; the checkpoint ships as package data
        f.chmod(0o644)
    summary = {"shards": shards, "bytes": writer.total_bytes, **(extra or {})}
    write_json(out_dir / "training.json", summary)
    return summary


def load_checkpoint(path: Path) -> DemoK3:
    """A training model holding the checkpoint's weights (experts dequantised exactly, bf16 upcast to fp32)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    model = DemoK3(config_from_checkpoint(raw))
    index = CheckpointIndex.open(path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for short in inventory(KimiK3Config.from_hf(raw)):
        name = PREFIX + short
        if name not in index:
            raise CheckpointError(f"{path}: tensor {name!r} is missing")
        key = _expert_key(short)
        if key is None:
            state[short] = index.load(name).float()
        elif key[2] == "full":
            state[key[0]][key[1]] = index.load(name).float()
        elif key[2] == "packed":
            scale = index.load(name.replace("weight_packed", "weight_scale"))
            state[key[0]][key[1]] = dequant_mxfp4(index.load(name), scale, name=name)
    model.load_state_dict(state, strict=True)
    return model.eval()
