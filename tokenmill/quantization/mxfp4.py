"""MXFP4, as gpt-oss checkpoints ship their experts (`quantization_config.quant_method ==
"mxfp4"`): each weight row in blocks of 32 values, each value a 4-bit float (E2M1: sign, two
exponent bits, one mantissa bit) packed two to a byte, low nibble first, each block scaled by
a power of two stored as a biased 8-bit exponent (E8M0, 127 meaning 2**0).

`*_blocks` `[..., rows, in / 32, 16]` uint8 and `*_scales` `[..., rows, in / 32]` uint8 are
kept as they are (4.25 bits a weight); `dequantize` expands one expert's at run time, so a
step reads only its active experts' 4-bit weights.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

BLOCK = 32  # values per scale
# The 16 E2M1 values, by code: the low three bits are the magnitude, the high one the sign.
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _MAGNITUDES + tuple(-value for value in _MAGNITUDES)
_SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., rows, in]` in `dtype` from `blocks` `[..., rows, in / 32, 16]` and `scales`
    `[..., rows, in / 32]`, as transformers' `convert_moe_packed_tensors` computes it (exactly:
    E2M1 values times powers of two are exact in bfloat16 and float32). One lookup per byte
    (both of its values) and one per scale, then a product: ~4x faster than looking nibbles up
    and `ldexp`, and it runs for every active expert of every step."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            "expected [..., rows, groups, 16] and [..., rows, groups]"
        )
    pairs, powers = _tables(dtype, blocks.device)
    values = F.embedding(blocks.long(), pairs).flatten(-2)  # [..., groups, 32]
    values = values * F.embedding(scales.long(), powers)  # [..., groups, 1]
    return values.flatten(-2)


@functools.cache
def _tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two values of each byte `[256, 2]` (low nibble first) and each scale's power of
    two `[256, 1]` (2**-127 is below bfloat16's normal range: 0 there, as no weight uses it)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    pairs = torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1)
    powers = torch.exp2(torch.arange(256, dtype=torch.float64) - _SCALE_BIAS).unsqueeze(-1)
    return pairs.to(dtype=dtype, device=device), powers.to(dtype=dtype, device=device)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`blocks`, `scales`) of `weight` `[..., rows, in]` (in a multiple of 32): each block's
    scale the power of two that brings its largest magnitude within 6, each value rounded to
    the nearest E2M1 value. For tests and tools that make MXFP4 checkpoints."""
    *lead, rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"MXFP4 needs rows of a multiple of {BLOCK} values, not {cols}")
    groups = weight.float().reshape(*lead, rows, cols // BLOCK, BLOCK)
    largest = groups.abs().amax(dim=-1).clamp_min(2.0**-126)
    exponents = torch.ceil(torch.log2(largest / 6.0)).clamp(-_SCALE_BIAS, _SCALE_BIAS)
    scaled = groups / torch.exp2(exponents).unsqueeze(-1)
    table = torch.tensor(_MAGNITUDES)
    magnitude = (scaled.abs().unsqueeze(-1) - table).abs().argmin(dim=-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    pairs = codes.reshape(*lead, rows, cols // BLOCK, BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponents + _SCALE_BIAS).to(torch.uint8)


# E8M0 exponents whose scale, halved, float16 holds exactly (2**-24 .. 2**15).
_FLOAT16_EXPONENTS = (_SCALE_BIAS + 1 - 24, _SCALE_BIAS + 1 + 15)


def native_linear(blocks: torch.Tensor, scales: torch.Tensor) -> Any | None:
    """The weight `[rows, in]` as the native kernels' 5-bit `PackedLinear`, exactly: twice
    each E2M1 value is an integer in -12..12 (a 5-bit code) and half of each scale a float16
    power of two per group of 32, the layout of GGUF's Q5 weights (kernels/int_linear.py).
    None where the native kernels are missing or a scale is outside float16's range. Its
    products quantize bfloat16 activations to int8 per 32, as every integer-code product."""
    from tokenmill.kernels.int_linear import native_quant_linear, pack
    from tokenmill.kernels.native import native_kernels

    low, high = _FLOAT16_EXPONENTS
    if native_kernels() is None or int(scales.min()) < low or int(scales.max()) > high:
        return None
    pairs, _ = _tables(torch.float32, blocks.device)
    codes = (F.embedding(blocks.long(), pairs).flatten(-3) * 2).to(torch.int8)
    halves = torch.exp2(scales.double() - (_SCALE_BIAS + 1)).to(torch.float16)
    return native_quant_linear(pack(codes, halves, None, 5, BLOCK))
