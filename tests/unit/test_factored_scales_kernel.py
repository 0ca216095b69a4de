"""K-quant weights whose scales are held factored (int8 sub-scales times a float16 scale per
256 columns, as GGUF's Q6_K / Q5_K / Q4_K / Q3_K / Q2_K / IQ4_XS load): the native product at
every ISA level this CPU runs against its torch reference. The VNNI level multiplies the
sub-scales in integers (csrc/int_linear.cpp's block_vnni_factored); the others in float."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.int_linear import (
    IQ4_NL_VALUES,
    SUPER_COLS,
    code_range,
    kernel_reference,
    pack,
    quant_linear,
)

MODULE = native.native_kernels()
pytestmark = pytest.mark.skipif(MODULE is None, reason="native kernels not buildable here")
LEVELS = list(range(MODULE.detect_isa() + 1)) if MODULE is not None else []


def factored_weight(bits: int | str, group: int, offsets: bool, seed: int):
    """A 40 x 512 weight (two super-blocks a row) whose scales factor exactly."""
    out_features, in_features = 40, 2 * SUPER_COLS
    generator = torch.Generator().manual_seed(seed)
    if bits == "iq4":
        index = torch.randint(0, 16, (out_features, in_features), generator=generator)
        codes, codebook, width = IQ4_NL_VALUES[index], IQ4_NL_VALUES, 4
    else:
        low, high = code_range(bits)
        codes = torch.randint(low, high + 1, (out_features, in_features), generator=generator)
        codebook, width = None, bits
    groups = in_features // group
    subs = torch.randint(-128, 128, (out_features, groups), generator=generator)
    subs[:, 0] = 127  # each super-block's largest where K-quants put it
    subs[:, SUPER_COLS // group] = -128
    supers = (torch.rand(out_features, 2, generator=generator) * 1e-3).half().float()
    scales = subs.float() * supers.repeat_interleave(SUPER_COLS // group, dim=1)
    offs = torch.randn(out_features, groups, generator=generator) * 0.01 if offsets else None
    weight = pack(codes.to(torch.int8), scales, offs, width, group, codebook)
    assert weight.super_scales is not None, "the scales did not factor"
    return weight


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: native.ISA_LEVELS[level])
@pytest.mark.parametrize("rows", [1, 2, 9])
@pytest.mark.parametrize(
    ("bits", "group", "offsets"),
    [
        (6, 16, False),
        (5, 32, True),
        (4, 32, True),
        (3, 16, False),
        (2, 16, True),
        ("iq4", 32, False),
    ],
)
def test_factored_scales_match_the_reference(level: int, rows: int, bits, group, offsets) -> None:
    weight = factored_weight(bits, group, offsets, seed=rows)
    generator = torch.Generator().manual_seed(rows + 100)
    x = torch.randn(rows, weight.in_features, generator=generator)
    bias = torch.randn(weight.out_features, generator=generator)
    with native.using_isa(level):
        got = quant_linear(x, weight, bias)
        reference = kernel_reference(x, weight, bias)
    assert (got - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()
