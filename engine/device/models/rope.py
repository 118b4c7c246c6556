"""Rotary position embeddings: the inverse frequencies of each scaling type, as transformers computes
them, and the cos/sin tables the layers read by position.

A table is [max_positions, rotary_dim] (the frequencies twice, as `rotate_half` pairs dimension d
with d + rotary_dim / 2), already multiplied by the scaling's attention factor (yarn, longrope).
Longrope switches from its short to its long factors at `original_max_position_embeddings`: a
token at position p uses the long ones when p + 1 exceeds it, as a decode step in transformers
does (transformers also recomputes a whole prompt that crosses the boundary with the long ones;
we do not, so such a prompt's first tokens keep the short factors).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _kind(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def inv_freq(theta: float, dim: int, scaling: dict[str, Any] | None, max_positions: int) -> torch.Tensor:
    """Inverse frequencies [dim / 2] for rope over `dim` dimensions (default, linear, llama3, yarn;
    longrope: its short factors, `longrope_inv_freq` gives both)."""
    kind = _kind(scaling)
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind == "default":
        return base.float()
    assert scaling is not None
    if kind == "linear":
        return (base / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / factor, base)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled).float()
    if kind == "yarn":
        return _yarn(theta, dim, scaling, max_positions)[0]
    if kind == "longrope":
        return longrope_inv_freq(theta, dim, scaling)[0]
    raise ValueError(
        f"unsupported rope scaling type {kind!r}: expected default, linear, llama3, yarn or longrope"
    )


def attention_factor(scaling: dict[str, Any] | None, max_positions: int) -> float:
    """What the scaling multiplies cos and sin by (1 but for yarn and longrope)."""
    kind = _kind(scaling)
    if kind == "yarn":
        assert scaling is not None
        return _yarn_attention(scaling, max_positions)
    if kind == "longrope":
        assert scaling is not None
        return _longrope_factor(scaling, max_positions)
    return 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, scaling: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`, in float32 as it computes them."""
    old_len = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / old_len)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, _yarn_attention(scaling, max_positions)


def _yarn_attention(scaling: dict[str, Any], max_positions: int) -> float:
    """Yarn's attention factor: given, or from the factor (and mscale, mscale_all_dim)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(
        scaling.get("factor") or max_positions / float(scaling["original_max_position_embeddings"])
    )
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def _longrope_factor(scaling: dict[str, Any], max_positions: int) -> float:
    old_len = float(scaling["original_max_position_embeddings"])
    attention = scaling.get("attention_factor")
    if attention is not None:
        return float(attention)
    factor = float(scaling.get("factor") or max_positions / old_len)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def longrope_inv_freq(theta: float, dim: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(short, long) inverse frequencies of longrope, in float32 as transformers computes them."""
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def of(factors: list[float]) -> torch.Tensor:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**shape)

    return of(scaling["short_factor"]), of(scaling["long_factor"])


def rope_tables(
    theta: float,
    dim: int,
    scaling: dict[str, Any] | None,
    max_positions: int,
    model_max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_positions, dim] in `dtype` on `device`; `model_max_positions` is the config's
    max_position_embeddings (what yarn and longrope derive a missing factor from)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    if _kind(scaling) == "longrope":
        assert scaling is not None
        short, long = longrope_inv_freq(theta, dim, scaling)
        boundary = int(scaling["original_max_position_embeddings"])
        freqs = torch.where((t + 1 > boundary).unsqueeze(1), torch.outer(t, long), torch.outer(t, short))
    else:
        freqs = torch.outer(t, inv_freq(theta, dim, scaling, model_max_positions))
    emb = torch.cat([freqs, freqs], dim=-1)
    factor = attention_factor(scaling, model_max_positions)
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
