"""Rotary position embeddings (RoPE), with the `rope_scaling` kinds Llama-family checkpoints use."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings of a config as one dict with `rope_type` and `rope_theta`, whether it
    was written by transformers 5 (`rope_parameters`) or by older versions and most checkpoints
    on the hub (`rope_theta` + `rope_scaling`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def inverse_frequencies(
    head_dim: int, params: dict[str, Any], max_position: int | None = None
) -> torch.Tensor:
    """`max_position`: the context served, which picks LongRoPE's short or long factors for
    every position (as llama.cpp does; transformers switches a sequence to the long ones,
    recomputing its cache, once it outgrows the original context; vLLM per step)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, params)
    if rope_type == "longrope":
        original = int(params["original_max_position_embeddings"])
        long = max_position is not None and max_position > original
        return _longrope_scaled(head_dim, base, params["long_factor" if long else "short_factor"])
    if rope_type == "yarn":
        return _yarn_scaled(inv_freq, head_dim, base, params)
    return inv_freq


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """The leading dimensions of each head that RoPE rotates (`partial_rotary_factor`: Phi)."""
    return int(head_dim * float(params.get("partial_rotary_factor") or 1.0))


def _longrope_scaled(dim: int, base: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE (Phi-3): each frequency divided by its own factor."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)


def _longrope_attention_factor(params: dict[str, Any]) -> float:
    """LongRoPE's scaling of cos and sin: sqrt(1 + ln(factor) / ln(original context)), with
    factor the context's growth, as transformers computes it where the config gives none."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or float(params["max_position_embeddings"]) / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_factor(params: dict[str, Any]) -> float:
    factor = params.get("factor")
    if factor is None:
        original = float(params["original_max_position_embeddings"])
        factor = float(params["max_position_embeddings"]) / original
    return float(factor)


def _yarn_scaled(
    inv_freq: torch.Tensor, dim: int, base: float, params: dict[str, Any]
) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies above `beta_fast` rotations over the original context
    kept, those below `beta_slow` divided by `factor`, a linear ramp between; as transformers'
    `_compute_yarn_parameters`."""
    factor = _yarn_factor(params)
    original = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def _yarn_attention_factor(params: dict[str, Any]) -> float:
    """YaRN's scaling of cos and sin: `attention_factor`, else 0.1 ln(factor) + 1 (with
    DeepSeek's mscale / mscale_all_dim ratio where both are given)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are divided by `factor`,
    short ones kept, and the band between interpolated smoothly."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE for flat `[num_tokens, num_heads, head_dim]` queries and keys, in the rotate-half
    layout of Hugging Face Llama checkpoints. `cos_sin` is looked up once per forward pass and
    shared by every layer.

    The sine table is stored with its first half negated, so that rotating is `x * cos +
    swap_halves(x) * signed_sin`: the same products as transformers' `rotate_half` (negating is
    exact), without a `neg` and a `cat` per call.
    """

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim(head_dim, params)
        self.max_position = max_position
        self.inv_freq = inverse_frequencies(self.rotary_dim, params, max_position)
        rope_type = params["rope_type"]
        self.attention_factor = 1.0
        if rope_type == "longrope":
            self.attention_factor = _longrope_attention_factor(params)
        elif rope_type == "yarn":
            self.attention_factor = _yarn_attention_factor(params)
        cos, signed_sin = self.tables(torch.float32)
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("signed_sin", signed_sin.to(dtype), persistent=False)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, signed_sin)` of every position, `[max_position, rotary_dim]`, computed in
        float32 and returned in `dtype` (the fused decoder stack keeps float32 ones)."""
        positions = torch.arange(self.max_position, dtype=torch.float, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.inv_freq)
        cos = torch.cat((freqs, freqs), dim=-1).cos()
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        if self.attention_factor != 1.0:  # LongRoPE's, YaRN's
            cos, signed_sin = cos * self.attention_factor, signed_sin * self.attention_factor
        return cos.to(dtype), signed_sin.to(dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, signed_sin)` of each position, `[num_tokens, 1, head_dim]`."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate `[num_tokens, heads, head_dim]` (a view is fine: queries and keys of a fused
    projection's output can be rotated together, in place) by `cos_sin`'s tables; where they
    are narrower than a head (partial rotary), only its leading dimensions."""
    if cos.shape[-1] != x.shape[-1]:
        x = x[..., : cos.shape[-1]]
    num_tokens, num_heads, head_dim = x.shape
    halves = x.view(num_tokens, num_heads, 2, head_dim // 2)
    swapped = halves.flip(2).view(num_tokens, num_heads, head_dim)  # a copy: read before x changes
    x.mul_(cos)
    x.add_(swapped.mul_(signed_sin))
