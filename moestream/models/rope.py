"""Rotary position embeddings: inverse frequencies from a config's rope parameters, and their application.

Owns rope variants (default, linear, yarn, llama3; any other `rope_type` is an UnsupportedModelError naming these)
and the two layouts (halves, as in Hugging Face's rotate_half, and interleaved pairs). It does not know about
attention or caches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moestream.errors import CheckpointError, UnsupportedModelError

ROPE_TYPES = ("default", "linear", "yarn", "llama3")


@dataclass
class Rope:
    inv_freq: torch.Tensor  # [D/2] fp32
    attention_factor: float = 1.0  # multiplies cos and sin (YaRN mscale)
    interleaved: bool = False

    _last: tuple | None = field(default=None, repr=False, compare=False)  # (positions, (cos, sin)) of the last call

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of positions [T]. Every layer of a step asks with the step's one positions tensor: the
        answer for the same tensor object is kept and given again (positions are never written in place)."""
        last = self._last
        if last is not None and last[0] is positions:
            return last[1]
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        out = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        self._last = (positions, out)
        return out

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """x [T, H, D]; cos/sin [T, D]. Each half is written once, with the same products and sums as
        x * cos + rotate_half(x) * sin (x1 c - x2 s rounds as x1 c + (-x2) s), so the values are bit for bit
        those of rotate_half; without its negated half, concatenated copy and full-width temporaries. `inplace`
        (halves layout, no grad): written over x, the same values with two half-width temporaries only."""
        if inplace and not self.interleaved and not x.requires_grad:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
            lo, hi = x2 * sin[:, None, :half], x1 * sin[:, None, half:]
            x1.mul_(cos[:, None, :half]).sub_(lo)
            x2.mul_(cos[:, None, half:]).add_(hi)
            return x
        if self.interleaved:
            t, h, d = x.shape
            x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        c1, c2 = cos[:, None, :half], cos[:, None, half:]
        s1, s2 = sin[:, None, :half], sin[:, None, half:]
        out = torch.empty_like(x)
        torch.mul(x1, c1, out=out[..., :half])
        out[..., :half] -= x2 * s1
        torch.mul(x2, c2, out=out[..., half:])
        out[..., half:] += x1 * s2
        return out


def rope_params(cfg: dict) -> dict:
    """The rope dict of an HF config: `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def build_rope(cfg: dict, dim: int, interleaved: bool = False) -> Rope:
    p = rope_params(cfg)
    kind = p["rope_type"]
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"config.json: rope_type {kind!r} is not supported; supported: "
                                    f"{', '.join(ROPE_TYPES)}")
    base = _number(p, "rope_theta")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return Rope(inv_freq, 1.0, interleaved)
    if kind == "linear":
        return Rope(inv_freq / _number(p, "factor"), 1.0, interleaved)
    if kind == "llama3":
        return Rope(_llama3(p, inv_freq), 1.0, interleaved)
    return _yarn(p, cfg, dim, base, interleaved)


def _number(p: dict, key: str) -> float:
    """A positive rope parameter, or a CheckpointError naming it."""
    v = p.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise CheckpointError(f"config.json: rope_type {p['rope_type']!r} needs a positive number {key}, got {v!r}")
    return float(v)


def _llama3(p: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: wavelengths longer than original/low_freq_factor are divided by
    `factor`, shorter than original/high_freq_factor kept, and the band between blends the two linearly in
    original/wavelength."""
    factor, low, high = _number(p, "factor"), _number(p, "low_freq_factor"), _number(p, "high_freq_factor")
    original = _number(p, "original_max_position_embeddings")
    if high <= low:
        raise CheckpointError(f"config.json: llama3 rope needs high_freq_factor ({high}) > low_freq_factor ({low})")
    wavelen = 2 * math.pi / inv_freq
    blend = ((original / wavelen - low) / (high - low)).clamp(0, 1)  # 0: long (scaled), 1: short (kept)
    return inv_freq / factor * (1 - blend) + inv_freq * blend


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: dict, cfg: dict, dim: int, base: float, interleaved: bool) -> Rope:
    factor = _number(p, "factor")
    original = p.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
    if isinstance(original, bool) or not isinstance(original, (int, float)) or original <= 0:
        raise CheckpointError("config.json: yarn rope needs original_max_position_embeddings or "
                              f"max_position_embeddings, got {original!r}")
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(rot: float) -> float:
        return (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return Rope(inv_freq, float(attention_factor), interleaved)
