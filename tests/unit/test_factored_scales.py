"""Scales that are a float16 per 256 columns times small integers (GGUF's K-quants and IQ4_XS:
`d * sc`) are held factored as the file holds them, exactly, and multiplied at every ISA level."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.int_linear import (
    SUPER_COLS,
    code_range,
    dequantize,
    factor_scales,
    kernel_reference,
    pack,
    packed_rows,
    quant_linear,
)
from tokenmill.kernels.native import ISA_LEVELS

MODULE = native.native_kernels()
pytestmark = pytest.mark.skipif(MODULE is None, reason="native kernels not buildable here")
LEVELS = list(range(MODULE.detect_isa() + 1)) if MODULE is not None else []


def k_quant_scales(rows: int, cols: int, group: int, largest: int, seed: int) -> torch.Tensor:
    """float32 `[rows, groups]`: a float16 `d` per super-block times integers in
    [-largest, largest] (one of them at +-largest, as llama.cpp's quantizers leave it)."""
    generator = torch.Generator().manual_seed(seed)
    per_super = SUPER_COLS // group
    d = (torch.rand(rows, cols // SUPER_COLS, generator=generator) * 1e-3 + 1e-5).half().float()
    subs = torch.randint(
        -largest, min(largest, 127) + 1, (rows, cols // SUPER_COLS, per_super), generator=generator
    )
    subs[..., 0] = -largest
    return (subs * d[..., None]).view(rows, -1)


def test_k_quant_scales_factor_exactly_and_others_do_not() -> None:
    scales = k_quant_scales(48, 512, 16, 128, seed=1)  # Q6_K's int8 scales
    subs, supers = factor_scales(scales, 16)
    per_super = SUPER_COLS // 16
    assert torch.equal(subs.float() * supers.float().repeat_interleave(per_super, 1), scales)
    assert factor_scales(torch.rand(48, 32) * 0.01, 16) is None  # arbitrary float scales
    # A quantizer that leaves its largest sub-scale short of the extreme (50 of 63).
    unusual = k_quant_scales(16, 512, 32, 50, seed=5)
    subs, supers = factor_scales(unusual, 32)
    assert torch.equal(subs.float() * supers.float().repeat_interleave(8, 1), unusual)
    assert factor_scales(k_quant_scales(8, 512, 32, 63, seed=2)[:, :12], 32) is None  # 384 cols


@pytest.mark.parametrize(("bits", "group", "largest"), [(6, 16, 128), (4, 32, 63), (4, 16, 32)])
def test_factored_weights_are_held_smaller_and_read_back_exactly(bits, group, largest) -> None:
    rows, cols = 40, 512
    low, high = code_range(bits)
    codes = torch.randint(low, high + 1, (rows, cols), generator=torch.Generator().manual_seed(3))
    scales = k_quant_scales(rows, cols, group, largest, seed=4)
    weight = pack(codes.to(torch.int8), scales, None, bits, group)
    assert weight.super_scales is not None and weight.scales.dtype == torch.int8
    expected = (codes.float().view(rows, -1, group) * scales[..., None]).view(rows, cols)
    assert torch.equal(dequantize(weight), expected)  # no float16 rounding of d * sc
    assert torch.equal(packed_rows(weight, torch.tensor([39, 2])), expected[[39, 2]])
    plain = pack(codes.to(torch.int8), scales.half().float() + 0.0, None, bits, group)
    held = weight.scales.numel() + 2 * weight.super_scales.numel()
    assert held <= plain.scales.numel() * 2 * 0.625  # 1 byte a group + 2 per super-block


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: ISA_LEVELS[level])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize(
    ("bits", "group", "offsets"), [(6, 16, False), (4, 32, True), (5, 32, True)]
)
def test_factored_products_match_the_reference(level, rows, bits, group, offsets) -> None:
    out_features, in_features = 33, 512
    generator = torch.Generator().manual_seed(rows)
    low, high = code_range(bits)
    codes = torch.randint(low, high + 1, (out_features, in_features), generator=generator)
    scales = k_quant_scales(out_features, in_features, group, 63, seed=rows)
    offs = torch.randn(out_features, in_features // group, generator=generator) * 1e-3
    weight = pack(codes.to(torch.int8), scales, offs if offsets else None, bits, group)
    assert weight.super_scales is not None
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    with native.using_isa(level):
        got = quant_linear(x, weight, bias)
        reference = kernel_reference(x, weight, bias)
    tolerance = 1e-2 if level == ISA_LEVELS.index("amx") and rows >= 32 else 1e-5
    assert (got - reference).abs().max().item() <= tolerance * reference.abs().max().item()
