"""One sequence's state from config.json alone: KV rows, MLA latent rows and KDA recurrent state per layer.

Owns the per-layer formulas the models allocate by (attention.KVSlot: K and V rows of kv_heads x head_dim;
mla.MLASlot: kv_lora_rank + qk_rope_head_dim per token; kda.KDAState: the [H, dk, dv] matrix and the q/k/v conv
windows, fixed size), KV and latent rows in the `--kv-dtype` storage (fp32, bf16, or int8 / int4 with their group
scales) and
recurrent state in fp32 as the engine keeps them, and feeds them to the server's `StateProfile`, so the bytes a sequence reaches at a context
replay the engine's block allocation exactly as admission does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moestream.errors import UnsupportedModelError
from moestream.kernels.kvquant import bits_of
from moestream.memory.state import host_bytes_of, kv_dtype as storage_of, stored_row_bytes
from moestream.models.kimi_linear import FULL
from moestream.server.prefix import StateProfile

FP32 = 4


@dataclass
class StateShape:
    """Per token: bytes of each growing buffer (one entry per buffer); per sequence: fixed bytes."""

    row_bytes: list[int]
    fixed_bytes: int
    kinds: dict[str, int]  # layer kind -> how many layers ("GQA KV", "MLA latent", "KDA state")
    kv_dtype: str = "fp32"  # storage of the growing rows (recurrent state stays fp32)
    host_bytes: int = 0  # a served sequence's booked Python-side bookkeeping (memory/state.py host_bytes_of)

    @property
    def bytes_per_token(self) -> int:
        return sum(self.row_bytes)

    def profile(self) -> StateProfile:
        return StateProfile.of_rows(self.row_bytes, self.fixed_bytes + self.host_bytes,
                                    bits_of(storage_of(self.kv_dtype)))

    def at(self, prompt: int, context: int, chunk: int) -> int:
        """Bytes one sequence holds at `context` tokens (prompt fed `chunk` at a time), growth slack included."""
        return self.profile().reserve(prompt, max(prompt, context), chunk)

    def describe(self) -> str:
        parts = [f"{n} {kind}" for kind, n in self.kinds.items() if n]
        return (f"{', '.join(parts)}: {self.bytes_per_token} bytes per token of context ({self.kv_dtype} KV / latent "
                f"rows, --kv-dtype) + {self.fixed_bytes} fixed bytes per sequence (recurrent state, fp32) + "
                f"{self.host_bytes} bytes of bookkeeping")


def _mla_row(raw: dict, kv: Callable[[tuple[int, ...]], int]) -> int:
    return kv((int(raw.get("kv_lora_rank", 512)) + int(raw.get("qk_rope_head_dim", 64)),))


def _kda_fixed(heads: int, dim: int, conv: int) -> int:
    return (heads * dim * dim + 3 * (conv - 1) * heads * dim) * FP32


def state_shape(config, kv_dtype: str = "fp32") -> StateShape:
    """The StateShape of a family's parsed config (ModelPlan.config), KV / latent rows stored as `kv_dtype`."""
    storage = storage_of(kv_dtype)  # a MoestreamError naming the choices for anything else
    shape = _shape(config, lambda row: stored_row_bytes(row, storage))
    shape.kv_dtype = kv_dtype
    shape.host_bytes = host_bytes_of(int(config.num_layers))
    return shape


def _shape(config, kv: Callable[[tuple[int, ...]], int]) -> StateShape:
    n = int(config.num_layers)
    kind = type(config).__name__
    if hasattr(config, "mla_layers"):  # Kimi K3: MLA at the listed layers, KDA elsewhere
        mla = len(config.mla_layers)
        row = kv((config.kv_lora_rank + config.rope_dim,))
        return StateShape([row] * mla, (n - mla) * _kda_fixed(config.kda_heads, config.kda_dim, config.conv_size),
                          {"MLA latent": mla, "KDA state": n - mla})
    if hasattr(config, "layer_types") and hasattr(config, "kda"):  # Kimi Linear: "full" layers are MLA
        kda = config.kda
        full = [t for t in config.layer_types if t == FULL]
        mla = config.mla
        row = kv((mla.kv_lora_rank + mla.qk_rope_head_dim,))
        rest = n - len(full)
        return StateShape([row] * len(full), rest * _kda_fixed(kda.heads, kda.head_dim, kda.conv_kernel),
                          {"MLA latent": len(full), "KDA state": rest})
    if hasattr(config, "kv_heads") and hasattr(config, "head_dim"):  # GQA: K and V buffers per layer
        row = kv((config.kv_heads, config.head_dim))
        return StateShape([row, row] * n, 0, {"GQA KV": n})
    if hasattr(config, "fp8_block"):  # DeepSeek-V3 / Kimi K2: MLA everywhere
        return StateShape([_mla_row(config.raw, kv)] * n, 0, {"MLA latent": n})
    raise UnsupportedModelError(f"plan: no state formula for {kind}")
