"""The int8-activation kernels at the ends of their integer ranges, at every ISA level: codes
all at a width's lowest or highest value (8-bit -128, IQ4's -127) against activations that
quantize to +-127. AVX2's vpmaddubsw adds pairs of unsigned x signed byte products in
saturating int16: a kernel that fed it 8-bit codes as unsigned (255 x 127 x 2 > 32767), or
added two 6-bit pairs too many, would clip here and nowhere in random inputs."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.int_linear import (
    IQ4_NL_VALUES,
    code_range,
    kernel_reference,
    pack,
    quant_linear,
)
from tokenmill.kernels.native import ISA_LEVELS

MODULE = native.native_kernels()
pytestmark = pytest.mark.skipif(MODULE is None, reason="native kernels not buildable here")
LEVELS = list(range(MODULE.detect_isa() + 1)) if MODULE is not None else []
ROWS, COLS = 32, 256


def extreme_codes(bits: int, codebook: bool, end: str) -> torch.Tensor:
    """`[ROWS, COLS]` codes all at one end of the width's range (or alternating ends)."""
    low, high = (-127, 113) if codebook else code_range(bits)
    pattern = {"low": [low], "high": [high], "both": [low, high]}[end]
    values = torch.tensor(pattern, dtype=torch.int8).repeat(COLS // len(pattern))
    return values.expand(ROWS, COLS).clone()


@pytest.mark.parametrize("level", LEVELS, ids=lambda level: ISA_LEVELS[level])
@pytest.mark.parametrize("end", ["low", "high", "both"])
@pytest.mark.parametrize(
    ("bits", "codebook", "group"),
    [
        (8, False, 32),
        (6, False, 16),
        (5, False, 32),
        (4, False, 32),
        (3, False, 16),
        (2, False, 16),
        (4, True, 32),
    ],
    ids=["8", "6", "5", "4", "3", "2", "iq4"],
)
def test_extreme_codes_and_activations_do_not_saturate(level, end, bits, codebook, group) -> None:
    codes = extreme_codes(bits, codebook, end)
    # K-quant-like scales (factored into int8 x float16 per 256 columns) and plain ones.
    scales = torch.full((ROWS, COLS // group), 2.0**-8)
    scales[:, ::2] = 2.0**-7
    table = IQ4_NL_VALUES if codebook else None
    weight = pack(codes, scales, None, bits, group, codebook=table)
    signs = torch.ones(4, COLS)
    signs[1] = -1.0
    signs[2, ::2] = -1.0  # each pair of columns: one +127, one -127
    signs[3, 1::2] = -1.0
    with native.using_isa(level):
        got = quant_linear(signs, weight, None)
        reference = kernel_reference(signs, weight, None)
    assert (got - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()
