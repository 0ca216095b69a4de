"""2- and 3-bit codes (GGUF's Q2_K and Q3_K at their own width: bit pairs, plus a high-bit
mask for 3 bits) through the native kernels at every ISA level, against their reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.int_linear import (
    code_range,
    dequantize,
    kernel_reference,
    pack,
    packed_rows,
    quant_linear,
)
from tokenmill.kernels.native import ISA_LEVELS

MODULE = native.native_kernels()
pytestmark = pytest.mark.skipif(MODULE is None, reason="native kernels not buildable here")
LEVELS = list(range(MODULE.detect_isa() + 1)) if MODULE is not None else []


def narrow_weight(bits: int, out_features: int, in_features: int, group: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    low, high = code_range(bits)
    codes = torch.randint(low, high + 1, (out_features, in_features), generator=generator)
    groups = in_features // group
    scales = torch.rand(out_features, groups, generator=generator) * 0.02 + 1e-3
    offsets = torch.randn(out_features, groups, generator=generator) * 0.01
    return codes.to(torch.int8), scales, offsets


@pytest.mark.parametrize("bits", [3, 2])
def test_narrow_codes_round_trip_and_are_held_at_their_width(bits: int) -> None:
    codes, scales, _ = narrow_weight(bits, 33, 96, 16, seed=1)
    weight = pack(codes, scales, None, bits, 16)
    assert weight.codes.numel() == 48 * 96 * bits // 8  # 3 blocks of 16 rows
    expected = codes.float().view(33, 6, 16) * scales.half().float()[..., None]
    assert torch.equal(dequantize(weight), expected.view(33, 96))
    rows = torch.tensor([32, 0, 17])
    assert torch.equal(packed_rows(weight, rows), dequantize(weight)[rows])


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: ISA_LEVELS[level])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize(("out_features", "in_features", "group"), [(40, 256, 16), (17, 64, 32)])
def test_narrow_products_match_the_reference(level, rows, bits, out_features, in_features, group):
    codes, scales, offsets = narrow_weight(bits, out_features, in_features, group, seed=rows)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    with native.using_isa(level):
        for with_offsets in (False, True):
            weight = pack(codes, scales, offsets if with_offsets else None, bits, group)
            got = quant_linear(x, weight, bias)
            reference = kernel_reference(x, weight, bias)
            tolerance = 1e-2 if level == ISA_LEVELS.index("amx") and rows >= 32 else 1e-5
            scale = reference.abs().max().item()
            assert (got - reference).abs().max().item() <= tolerance * scale
