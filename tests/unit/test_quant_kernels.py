"""The native quantized-linear kernels against their torch reference at every ISA level this
CPU runs (portable, AVX2, AVX-512 with float activations, AVX512_BF16/VNNI with int8 ones, AMX
tiles for many rows), over odd shapes, every code width (8, 6, 5, 4), group sizes, offsets
and row counts;
the packed layout's round trip; the int8 and int4 layers with and without the native
kernels."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import ConfigError
from tokenmill.kernels import native
from tokenmill.kernels.int_linear import (
    AMX_LEVEL,
    FLOAT_ACTIVATIONS_LEVELS,
    IQ4_NL_VALUES,
    activation_level,
    amx_min_rows,
    code_range,
    dense_bf16_reference,
    dequantize,
    kernel_reference,
    native_quant_linear,
    pack,
    packed_rows,
    quant_linear,
    quant_linear_reference,
    quantize_activations_reference,
)
from tokenmill.kernels.native import ISA_LEVELS
from tokenmill.layers.linear import Linear
from tokenmill.quantization.int4 import Int4LinearMethod, quantize_int4
from tokenmill.quantization.int8 import Int8GroupWeight, Int8LinearMethod, quantize_int8

needs_native = pytest.mark.skipif(
    native.native_kernels() is None, reason="native kernels not buildable here"
)
MODULE = native.native_kernels()
BEST = MODULE.detect_isa() if MODULE is not None else -1
LEVELS = list(range(BEST + 1))
# (out, in, group): odd row counts (padded to blocks of 16), widths padded to 32, groups of
# 16 / 32 / 128 and per row (None).
SHAPES = [(960, 576, None), (7, 40, None), (33, 96, 32), (130, 256, 128), (17, 64, 16)]


def random_weight(out_features: int, in_features: int, bits: int, group: int | None, seed: int):
    generator = torch.Generator().manual_seed(seed)
    low, high = code_range(bits)
    codes = torch.randint(low, high + 1, (out_features, in_features), generator=generator)
    groups = 1 if group is None else in_features // group
    scales = torch.rand(out_features, groups, generator=generator) * 0.02 + 1e-3
    offsets = torch.randn(out_features, groups, generator=generator) * 0.01
    return codes.to(torch.int8), scales, offsets


@needs_native
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("bits", [8, 6, 5, 4])
@pytest.mark.parametrize(("out_features", "in_features", "group"), SHAPES)
def test_packing_round_trips(out_features, in_features, group, bits, offsets) -> None:
    if bits == 4 and group is None:
        group = 32 if in_features % 32 == 0 else None
    if bits == 4 and group is None:
        pytest.skip("int4 comes in groups")
    codes, scales, offs = random_weight(out_features, in_features, bits, group, seed=1)
    weight = pack(codes, scales, offs if offsets else None, bits, group)
    grouped = codes.float().view(out_features, scales.shape[1], -1)
    expected = grouped * scales.half().float()[..., None]
    if offsets:
        expected = expected + offs.half().float()[..., None]
    assert torch.equal(dequantize(weight), expected.view(out_features, in_features))
    rows = torch.tensor([out_features - 1, 0, out_features // 2])
    assert torch.equal(packed_rows(weight, rows), dequantize(weight)[rows])


@needs_native
@pytest.mark.parametrize("weight_format", ["8", "6", "5", "4", "3", "2", "q6_k", "q4_k", "iq4"])
def test_native_row_lookup_equals_the_torch_unpacking(weight_format: str) -> None:
    """The embedding lookup of a quantized table (`PackedLinear.rows`, a model's every step)
    gives packed_rows' float32 rows bit for bit, in every code layout: int8, nibbles with
    high-bit masks or pairs, bit pairs, factored K-quant scales, the IQ4 codebook."""
    rows, cols = 40, 512
    generator = torch.Generator().manual_seed(11)
    factored = weight_format in ("q6_k", "q4_k")
    bits = {"q6_k": 6, "q4_k": 4, "iq4": 4}.get(weight_format) or int(weight_format)
    group = 16 if weight_format == "q6_k" else 32
    low, high = code_range(bits)
    codes = torch.randint(low, high + 1, (rows, cols), generator=generator).to(torch.int8)
    scales = torch.rand(rows, cols // group, generator=generator) * 0.02 + 1e-3
    offsets = torch.randn(rows, cols // group, generator=generator) * 0.01
    codebook = None
    if factored:  # int8 sub-scales times a float16 per 256 columns: held factored
        supers = (torch.rand(rows, cols // 256, 1, generator=generator) * 1e-3).half().float()
        subs = torch.randint(1, 64, (rows, cols // 256, 256 // group), generator=generator)
        scales, offsets = (subs * supers).view(rows, -1), None
    if weight_format == "iq4":
        codebook, offsets = IQ4_NL_VALUES, None
        codes = IQ4_NL_VALUES[torch.randint(0, 16, (rows, cols), generator=generator)]
    weight = pack(codes, scales, offsets, bits, group, codebook=codebook)
    assert (weight.super_scales is not None) == factored
    picked = torch.tensor([39, 0, 17, 17, 5])
    assert torch.equal(native_quant_linear(weight).rows(picked), packed_rows(weight, picked))
    with pytest.raises(RuntimeError, match="out of range"):
        native_quant_linear(weight).rows(torch.tensor([rows]))


@needs_native
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_looking_up_rows_reads_only_their_blocks(bits: int) -> None:
    """An embedding's lookup (a tied LM head's table) unpacks the rows' blocks, not the whole
    table: unpacking all of a 1B model's Q6_K vocabulary cost ~300 ms per decode step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    codes, scales, _ = random_weight(1024, 256, bits, 16 if bits == 6 else 32, seed=4)
    weight = pack(codes, scales, None, bits, 16 if bits == 6 else 32)
    largest = []

    class LargestResult(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    largest.append(t.numel())
            return out

    rows = torch.tensor([5, 1000])
    with LargestResult():
        looked_up = packed_rows(weight, rows)
    assert torch.equal(looked_up, dequantize(weight)[rows])
    assert max(largest) <= 2 * 16 * 256 * 8  # the two rows' 16-row blocks, unpacked


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 40])
@pytest.mark.parametrize("bits", [8, 6, 5, 4])
@pytest.mark.parametrize(("out_features", "in_features", "group"), SHAPES)
def test_quant_linear_matches_its_reference(
    isa: int, out_features, in_features, group, bits, rows, dtype
) -> None:
    if bits == 4 and group is None:
        pytest.skip("int4 comes in groups")
    codes, scales, offsets = random_weight(out_features, in_features, bits, group, seed=rows)
    for with_offsets in (False, True):
        weight = pack(codes, scales, offsets if with_offsets else None, bits, group)
        generator = torch.Generator().manual_seed(7)
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        bias = torch.randn(out_features, generator=generator)
        got = quant_linear(x, weight, bias)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        reference = kernel_reference(x, weight, bias)
        scale = reference.abs().max().item()
        # bfloat16 outputs: 8 bits; AMX: bfloat16 products summed in float32
        exact = dtype == torch.float32 and not (isa >= AMX_LEVEL and rows >= amx_min_rows())
        tolerance = 1e-5 if exact else 1e-2
        assert (got.float() - reference).abs().max().item() <= tolerance * scale


def k_quant_weight(out_features: int, in_features: int, bits: int, group: int, seed: int):
    """Codes with K-quant scales (`d * sc`: a float16 per 256 columns times a small integer
    per group: Q6_K's signed, its largest at -128, the others' 0-63, largest 63, as
    llama.cpp's quantizers put them), which `pack` holds factored."""
    generator = torch.Generator().manual_seed(seed)
    low, high = code_range(bits)
    codes = torch.randint(low, high + 1, (out_features, in_features), generator=generator)
    supers = (torch.rand(out_features, in_features // 256, 1, generator=generator) + 0.1) / 64
    per_super = 256 // group
    low_sub, largest = (-127, -128) if bits == 6 else (0, 63)
    shape = (out_features, in_features // 256, per_super)
    subs = torch.randint(low_sub, abs(largest), shape, generator=generator)
    subs[:, :, 0] = largest
    scales = (subs.float() * supers.half().float()).view(out_features, -1)
    offsets = torch.randn(out_features, in_features // group, generator=generator) * 0.01
    return codes.to(torch.int8), scales, offsets


@needs_native
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize(("bits", "group"), [(6, 16), (5, 32), (4, 32), (3, 16), (2, 16)])
def test_factored_scales_match_the_reference(isa: int, bits: int, group: int, rows: int) -> None:
    """Weights whose scales `pack` factors as the K-quants store them (the AVX2 int8 path
    applies the sub-scales in its pair sums and takes the codes' center off in float), at
    every level, with and without offsets, against the dequantized reference."""
    codes, scales, offsets = k_quant_weight(40, 512, bits, group, seed=bits + rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    for with_offsets in (False, True):
        weight = pack(codes, scales, offsets if with_offsets else None, bits, group)
        assert weight.super_scales is not None
        got = quant_linear(x, weight, None)
        reference = kernel_reference(x, weight, None)
        assert (got - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()


@needs_native
def test_many_rows_on_the_dot_product_kernel() -> None:
    """Prefill-sized products (tiles of 8 tokens, several threads) agree with the reference."""
    codes, scales, offsets = random_weight(200, 320, 4, 32, seed=3)
    weight = pack(codes, scales, offsets, 4, 32)
    x = torch.randn(300, 320, generator=torch.Generator().manual_seed(4))
    level = activation_level(BEST, quantized=True)
    with native.using_isa(BEST if level is None else level):
        reference = kernel_reference(x, weight, None)
        got = quant_linear(x, weight, None)
    error = (got - reference).abs()
    exact = 1e-5 * reference.abs().max().item()
    if level is None:
        assert error.max().item() <= exact
        return
    # int8 activations: the kernel and the reference round x / scale in different float
    # orders, so a value at a half step can land one code apart (measured: one row in ~6 of
    # 100 random inputs). Such a row is off by at most one code step times each weight row.
    step = x.abs().amax(dim=1, keepdim=True) / 127
    one_flip = step * dequantize(weight).abs().amax(dim=1)[None, :]
    assert (error <= exact + one_flip * 1.01).all()
    rows_off = (error > exact).any(dim=1).sum().item()
    assert rows_off <= 3, f"{rows_off} of 300 rows off by more than float rounding"


@needs_native
@pytest.mark.parametrize("bits", [8, 6, 5, 4])
def test_many_rows_where_amx_runs_go_to_its_tiles(bits: int) -> None:
    """From `amx_min_rows()` rows the weight is dequantized to bfloat16 chunk by chunk and
    multiplied on AMX tiles (bfloat16 rows); below, the VNNI kernel runs (int8 rows)."""
    if BEST < AMX_LEVEL:
        pytest.skip("no AMX bfloat16 tiles here (or not allowed)")
    codes, scales, offsets = random_weight(600, 128, bits, 32, seed=4)  # > 16 blocks: chunks
    weight = pack(codes, scales, offsets, bits, 32)
    rows = amx_min_rows()
    x = torch.randn(rows + 37, 128)
    bias = torch.randn(600)
    got = quant_linear(x, weight, bias)
    reference = dense_bf16_reference(x, weight, bias)
    # bfloat16 products summed in float32, then the bias added in float32.
    assert (got - reference).abs().max().item() <= 1e-4 * reference.abs().max().item()
    few = quant_linear(x[: rows - 1], weight, bias)  # the dot-product kernel
    dot_reference = quant_linear_reference(x[: rows - 1], weight, bias, True)
    assert (few - dot_reference).abs().max().item() <= 1e-5 * dot_reference.abs().max().item()


@needs_native
def test_int8_activations_round_as_their_reference_says() -> None:
    """The int8 paths (AVX2's vpmaddubsw, VNNI's vpdpbusd) multiply activations rounded per
    block of 32 (the reference's rounding, not float ones): at each such level this CPU runs,
    the product is much closer to that reference than to the float product."""
    levels = [level for level in LEVELS if level not in FLOAT_ACTIVATIONS_LEVELS]
    if not levels:
        pytest.skip("this CPU has no AVX2 or VNNI int8 kernels")
    codes, scales, _ = random_weight(64, 256, 8, None, seed=5)
    weight = pack(codes, scales, None, 8)
    x = torch.randn(4, 256)
    assert not torch.equal(quantize_activations_reference(x), x)
    float_product = quant_linear_reference(x, weight, None, quantized=False)
    int8_product = quant_linear_reference(x, weight, None, quantized=True)
    for level in levels:
        with native.using_isa(level):
            got = quant_linear(x, weight, None)
        gap = (float_product - int8_product).abs().max()
        assert (got - int8_product).abs().max() * 100 < gap, ISA_LEVELS[level]


@needs_native
def test_bad_inputs_are_clear_errors() -> None:
    codes, scales, _ = random_weight(16, 64, 8, None, seed=0)
    weight = pack(codes, scales, None, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        quant_linear(torch.randn(1, 64).double(), weight, None)
    with pytest.raises(RuntimeError, match="200 columns, the weight 64"):
        quant_linear(torch.randn(1, 200), weight, None)
    with pytest.raises(ValueError, match="do not tile"):
        pack(codes[:, :48], torch.ones(16, 3), None, 8, group_size=16)


def _layers(bits: int, dequantize_on: torch.device | None) -> tuple[torch.Tensor, Linear]:
    """A layer of `bits`-bit codes: int8 and int4 quantized online from floats, 5 and 6 bits
    loaded as a GGUF file's groups of 32 are (int8 groups whose codes fit the width)."""
    torch.manual_seed(bits)
    weight = torch.randn(48, 128)
    if bits in (5, 6):
        codes, scales, _ = random_weight(48, 128, bits, 32, seed=bits)
        quantized = weight = Int8GroupWeight(codes, scales.half().float())
        method = Int8LinearMethod(32, code_bits=bits, dequantize_on=dequantize_on)
    elif bits == 8:
        quantized, method = quantize_int8(weight), Int8LinearMethod(dequantize_on=dequantize_on)
    else:
        quantized = quantize_int4(weight, 32)
        method = Int4LinearMethod(32, dequantize_on=dequantize_on)
    layer = Linear(128, 48, method)
    method.load_weight(layer, weight, 0)
    method.process_weights_after_loading(layer)
    return quantized.dequantize(), layer


@needs_native
def test_codes_wider_than_the_declared_width_are_a_clear_error() -> None:
    codes, scales, _ = random_weight(16, 64, 6, 32, seed=0)
    method = Int8LinearMethod(32, code_bits=5)
    layer = Linear(64, 16, method)
    method.load_weight(layer, Int8GroupWeight(codes, scales), 0)
    with pytest.raises(ConfigError, match=r"int5-g32 weight with codes outside \[-16, 15\]"):
        method.process_weights_after_loading(layer)


@pytest.mark.parametrize("bits", [8, 6, 5, 4])
@pytest.mark.parametrize("storage", ["native", "torch-op", "dequantize-per-call"])
def test_layers_compute_the_dequantized_product(
    bits: int, storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the native kernels the layer holds only the packed weight; without them (no
    compiler) torch's int8/int4 CPU ops run, in bfloat16; with `dequantize_on` (a CUDA
    engine, `--linear-backend torch`) the codes are widened by torch ops per product."""
    if storage == "native" and native.native_kernels() is None:
        pytest.skip("native kernels not buildable here")
    if storage == "torch-op":
        monkeypatch.setenv("TOKENMILL_NATIVE_KERNELS", "0")
        native.reset_for_tests()
    try:
        on = torch.device("cpu") if storage == "dequantize-per-call" else None
        dequantized, layer = _layers(bits, on)
        x = torch.randn(5, 128)
        assert (layer.packed is not None) == (storage == "native")
        assert (layer.torch_weight is not None) == (storage == "dequantize-per-call")
        if storage == "native":
            assert torch.equal(dequantize(layer.packed), dequantized)
            reference = kernel_reference(x, layer.packed, None)
            torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-4)
        elif storage == "dequantize-per-call":
            rows = torch.tensor([47, 0, 5])
            assert torch.equal(layer.quant_method.dequantize_rows(layer, rows), dequantized[rows])
            torch.testing.assert_close(layer(x), x @ dequantized.T, rtol=1e-5, atol=1e-5)
        else:  # bfloat16 inputs and outputs
            torch.testing.assert_close(layer(x), x @ dequantized.T, rtol=2e-2, atol=0.2)
    finally:
        monkeypatch.delenv("TOKENMILL_NATIVE_KERNELS", raising=False)
        native.reset_for_tests()
