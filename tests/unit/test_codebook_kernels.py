"""Codes from a table (GGUF's IQ4_NL / IQ4_XS: 4-bit indices into llama.cpp's 16 int8 values)
through the native kernels at every ISA level, against their torch reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.int_linear import (
    IQ4_NL_VALUES,
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


def table_weight(out_features: int, in_features: int, group: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scales = torch.rand(out_features, in_features // group, generator=generator) * 1e-3 + 1e-4
    offsets = torch.randn(out_features, in_features // group, generator=generator) * 0.01
    return IQ4_NL_VALUES[indices], scales, offsets


def test_packing_a_codebook_round_trips() -> None:
    values, scales, _ = table_weight(33, 256, 32, seed=1)
    weight = pack(values, scales, None, 4, 32, codebook=IQ4_NL_VALUES)
    expected = values.float().view(33, 8, 32) * scales.half().float()[..., None]
    assert torch.equal(dequantize(weight), expected.view(33, 256))
    rows = torch.tensor([32, 0, 7])
    assert torch.equal(packed_rows(weight, rows), dequantize(weight)[rows])


def test_values_outside_the_codebook_are_a_clear_error() -> None:
    values, scales, _ = table_weight(16, 64, 32, seed=2)
    values[3, 5] = 0  # not one of IQ4_NL's values
    with pytest.raises(ValueError, match="outside the codebook"):
        pack(values, scales, None, 4, 32, codebook=IQ4_NL_VALUES)


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: ISA_LEVELS[level])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize(("out_features", "in_features", "group"), [(40, 256, 32), (17, 64, 16)])
def test_codebook_products_match_the_reference(level, rows, out_features, in_features, group):
    values, scales, offsets = table_weight(out_features, in_features, group, seed=rows)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    with native.using_isa(level):
        for with_offsets in (False, True):
            weight = pack(
                values, scales, offsets if with_offsets else None, 4, group, IQ4_NL_VALUES
            )
            got = quant_linear(x, weight, bias)
            reference = kernel_reference(x, weight, bias)
            tolerance = 1e-2 if level == ISA_LEVELS.index("amx") and rows >= 32 else 1e-5
            scale = reference.abs().max().item()
            assert (got - reference).abs().max().item() <= tolerance * scale
