"""The native grouped LoRA shrink/expand against the torch reference (lora/punica.py), at
every ISA level this CPU runs (the AVX2 and portable paths through `set_isa`, as
TOKENMILL_CPU_ISA does), in float32 and bfloat16 weights (the rows grouped by adapter and cut
into tiles: interleaved adapters, runs longer than a tile, odd widths and lengths), and a
`LoRALinear` over int8 and int4 bases: the base product plus the float adapter's."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import native
from tokenmill.kernels.lora import native_lora_available, native_lora_shrink_expand
from tokenmill.layers.linear import DenseLinearMethod, Linear
from tokenmill.lora.layer import LoRALinear, LoRAPart, StepLoRAMapping
from tokenmill.lora.peft_adapter import PeftAdapter
from tokenmill.lora.punica import add_lora_, add_lora_reference_
from tokenmill.quantization.int4 import Int4LinearMethod
from tokenmill.quantization.int8 import Int8LinearMethod

module = native.native_kernels()
needs_native = pytest.mark.skipif(module is None, reason="native kernels not buildable here")


def random_stack(slots: int, width: int, in_features: int, out_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, width, in_features, generator=generator) / in_features**0.5
    bt = torch.randn(slots, width, out_features, generator=generator) / width**0.5
    return a, bt


INTERLEAVED = [(row, row + 1, (row * 3) % 8) for row in range(64)]  # decode: 8 rows a slot


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "width", "in_features", "out_features", "segments"),
    [
        (1, 8, 64, 96, [(0, 1, 1)]),
        (7, 48, 576, 960, [(0, 2, 0), (3, 7, 2)]),  # row 2 runs the base
        (37, 24, 100, 1030, [(0, 5, 1), (5, 6, 0), (6, 37, 1)]),  # odd sizes: the tails
        (4, 16, 33, 17, []),
        (64, 48, 160, 272, INTERLEAVED),  # the grouping: each slot's rows apart
        (53, 5, 47, 45, [(0, 20, 3), (21, 53, 3)]),  # one slot over several tiles, odd width
    ],
)
def test_kernel_matches_reference(
    isa: int,
    dtype: torch.dtype,
    rows: int,
    width: int,
    in_features: int,
    out_features: int,
    segments,
) -> None:
    a, bt = random_stack(8, width, in_features, out_features, seed=rows)
    a[1, width // 2 :] = 0  # a rank below the width: those widths shrink to zeros
    x = torch.randn(rows, in_features)
    a, bt, x = a.to(dtype), bt.to(dtype), x.to(dtype)
    base = torch.randn(rows, out_features)
    expected = base.clone()
    add_lora_reference_(expected, x.float(), a.float(), bt.float(), segments)
    got = base.clone()
    native_lora_shrink_expand(got, x, a, bt, torch.tensor(segments, dtype=torch.int64).view(-1, 3))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@needs_native
def test_kernel_refuses_bad_segments() -> None:
    a, bt = random_stack(2, 8, 16, 16, seed=0)
    y, x = torch.zeros(4, 16), torch.zeros(4, 16)
    with pytest.raises(RuntimeError, match="segment out of range"):
        native_lora_shrink_expand(y, x, a, bt, torch.tensor([[0, 4, 2]]))
    with pytest.raises(RuntimeError, match="segment out of range"):
        native_lora_shrink_expand(y, x, a, bt, torch.tensor([[0, 5, 0]]))


def test_bfloat16_takes_the_reference() -> None:
    a, bt = random_stack(1, 8, 16, 16, seed=0)
    y, x = torch.zeros(2, 16, dtype=torch.bfloat16), torch.randn(2, 16, dtype=torch.bfloat16)
    assert not native_lora_available(y, x, a.bfloat16())
    add_lora_(y, x, a.bfloat16(), bt.bfloat16(), [(0, 2, 0)], torch.tensor([[0, 2, 0]]))
    assert y.abs().sum() > 0


@pytest.mark.parametrize(
    "method",
    [DenseLinearMethod, Int8LinearMethod, lambda: Int4LinearMethod(32)],
    ids=["float32", "int8", "int4-g32"],
)
def test_lora_linear_adds_the_adapter_to_any_base(method) -> None:
    """A fused q/k/v-like layer with three parts: base product, then each part's B A x."""
    torch.manual_seed(0)
    in_features, sizes, rank = 64, (32, 16, 16), 4
    weight = torch.randn(sum(sizes), in_features) / 8
    base = Linear(in_features, sum(sizes), method())
    base.quant_method.load_weight(base, weight, 0)
    base.quant_method.process_weights_after_loading(base)
    parts, start = [], 0
    for name, size in zip(("q_proj", "k_proj", "v_proj"), sizes):
        parts.append(LoRAPart(name, start, size))
        start += size
    mapping = StepLoRAMapping()
    layer = LoRALinear(base, 0, parts, in_features, 2, 8, torch.float32, mapping)
    pairs = {
        (0, "q_proj"): (torch.randn(rank, in_features), torch.randn(32, rank)),
        (0, "v_proj"): (torch.randn(rank, in_features), torch.randn(16, rank)),
    }
    layer.set_slot(1, PeftAdapter("t", 5, rank, pairs))
    x = torch.randn(5, in_features)
    base_out = base(x)
    mapping.segments = [(1, 4, 1)]
    mapping.segment_tensor = torch.tensor(mapping.segments)
    got = layer(x)
    expected = base_out.clone()
    expected[1:4, :32] += x[1:4] @ pairs[(0, "q_proj")][0].T @ pairs[(0, "q_proj")][1].T
    expected[1:4, 48:] += x[1:4] @ pairs[(0, "v_proj")][0].T @ pairs[(0, "v_proj")][1].T
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
