"""Quantized linears on the native kernels (`csrc/quant_linear.h`): the packed layout they
stream, packing into it at load time, and a torch reference of what they compute.

A weight arrives as signed integer codes with a float scale (and optionally an offset) per
group of `group_size` input columns: W = code * scale + offset. It is packed once:

- output rows in blocks of 16; in each block the codes of 4 consecutive input columns of the
  16 rows share 64 bytes (int8, one code + 128 per byte) or those of 8 columns do (int4, code
  + 8 per nibble: byte j of a row's 4 bytes holds column j low and column 4 + j high). One
  vector load then feeds a VNNI dot product for all 16 rows, and a block streams front to back
  (llama.cpp repacks its blocks into interleaved rows for the same reason);
- scales and offsets as float16 `[blocks, groups, 16]`, 16 consecutive rows per load.

Input columns are padded to a multiple of 32 (the activations' quantization block) with code
0; rows past `out_features` are padding too. A layer holds only the packed form: rows for an
embedding lookup are read back out of it (`packed_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.kernels.native import ISA_LEVELS, native_kernels

BLOCK_ROWS = 16
ACTIVATION_BLOCK = 32
# The first ISA level (tokenmill/kernels/native.py's ISA_LEVELS) whose kernels quantize the
# activations: avx512_bf16, which includes VNNI; and the level whose AMX tiles take products
# of many rows (csrc/quant_linear.h).
INT8_ACTIVATIONS_LEVEL = ISA_LEVELS.index("avx512_bf16")
AMX_LEVEL = ISA_LEVELS.index("amx")
_CENTER = {8: 128, 4: 8}


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernels' layout (module docstring)."""

    codes: torch.Tensor  # uint8 [blocks, 16 * padded_in * bits / 8]
    scales: torch.Tensor  # float16 [blocks, groups, 16]
    offsets: torch.Tensor | None
    bits: int
    group_size: int
    out_features: int
    in_features: int

    @property
    def padded_in(self) -> int:
        return self.scales.shape[1] * self.group_size

    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def padded_width(in_features: int, group_size: int | None) -> tuple[int, int]:
    """(padded input width, group size) for a weight of `in_features` columns in groups of
    `group_size` (None: one group per row, per-channel scales)."""
    if group_size is None:
        width = -(-in_features // ACTIVATION_BLOCK) * ACTIVATION_BLOCK
        return width, width
    if group_size % 16 or in_features % group_size or in_features % ACTIVATION_BLOCK:
        raise ValueError(
            f"groups of {group_size} do not tile {in_features} input columns in the packed "
            f"layout (needs a multiple of 16 dividing the width, the width of {ACTIVATION_BLOCK})"
        )
    return in_features, group_size


def pack(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int | None = None,
) -> PackedWeight:
    """Pack signed `codes` `[out, in]` (int8: -128..127, int4: -8..7) with `scales` (and
    `offsets`) `[out, groups]`; `group_size` None means one scale per row."""
    rows, cols = codes.shape
    width, group = padded_width(cols, group_size)
    blocks = -(-rows // BLOCK_ROWS)
    padded = torch.zeros(blocks * BLOCK_ROWS, width, dtype=torch.int16)
    padded[:rows, :cols] = codes.to(torch.int16)
    unsigned = (padded + _CENTER[bits]).to(torch.uint8)
    if bits == 8:
        lanes = unsigned.view(blocks, BLOCK_ROWS, width // 4, 4)
    elif bits == 4:
        nibbles = unsigned.view(blocks, BLOCK_ROWS, width // 8, 2, 4)
        lanes = nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)
    else:
        raise ValueError(f"{bits}-bit codes have no packed layout")
    packed_codes = lanes.permute(0, 2, 1, 3).contiguous().view(blocks, -1)
    return PackedWeight(
        packed_codes,
        _pack_groups(scales, blocks),
        None if offsets is None else _pack_groups(offsets, blocks),
        bits,
        group,
        rows,
        cols,
    )


def _pack_groups(values: torch.Tensor, blocks: int) -> torch.Tensor:
    rows, groups = values.shape
    padded = torch.zeros(blocks * BLOCK_ROWS, groups, dtype=torch.float16)
    padded[:rows] = values.to(torch.float16)
    return padded.view(blocks, BLOCK_ROWS, groups).transpose(1, 2).contiguous()


def packed_rows(weight: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """The dequantized float32 rows `rows` (output rows: an embedding's tokens) of a packed
    weight, `[len(rows), in_features]`."""
    block, lane = rows // BLOCK_ROWS, rows % BLOCK_ROWS
    width = weight.padded_in
    if weight.bits == 8:
        lanes = weight.codes.view(-1, width // 4, BLOCK_ROWS, 4)[block, :, lane]
        codes = lanes.reshape(len(rows), width).to(torch.int16) - 128
    else:
        lanes = weight.codes.view(-1, width // 8, BLOCK_ROWS, 4)[block, :, lane]
        nibbles = torch.stack([lanes & 0x0F, lanes >> 4], dim=2)  # [n, width/8, 2, 4]
        codes = nibbles.reshape(len(rows), width).to(torch.int16) - 8
    scales = weight.scales[block, :, lane].float()
    grouped = codes.float().view(len(rows), -1, weight.group_size) * scales[..., None]
    if weight.offsets is not None:
        grouped = grouped + weight.offsets[block, :, lane].float()[..., None]
    return grouped.view(len(rows), width)[:, : weight.in_features]


def dequantize(weight: PackedWeight) -> torch.Tensor:
    """The whole weight as float32 `[out, in]` (tests and references)."""
    return packed_rows(weight, torch.arange(weight.out_features))


def quantize_activations_reference(x: torch.Tensor) -> torch.Tensor:
    """What the VNNI path multiplies instead of `x`: each row's blocks of 32 columns rounded to
    int8 with scale max|x| / 127, dequantized (torch.round: to nearest even, as the kernel)."""
    rows, cols = x.shape
    width = -(-cols // ACTIVATION_BLOCK) * ACTIVATION_BLOCK
    padded = torch.zeros(rows, width)
    padded[:, :cols] = x.float()
    blocks = padded.view(rows, -1, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = (blocks * inverse).round().clamp(-127, 127)
    return (codes * (amax / 127.0)).view(rows, width)[:, :cols]


def activations_quantized(rows: int = 1) -> bool:
    """Whether the kernels quantize the activations of a product of `rows` rows to int8: at
    the ISA level in use, VNNI's (AVX512_BF16 and up), below the AMX path's rows."""
    module = native_kernels()
    if module is None or module.get_isa() < INT8_ACTIVATIONS_LEVEL:
        return False
    return not on_amx_tiles(rows)


def on_amx_tiles(rows: int) -> bool:
    """Whether a product of `rows` rows runs on AMX tiles, with bfloat16 activations and the
    weight dequantized to bfloat16 chunk by chunk (ISA level amx, `quant_amx_min_rows()`)."""
    module = native_kernels()
    return module is not None and module.get_isa() >= AMX_LEVEL and rows >= amx_min_rows()


def amx_min_rows() -> int:
    module = native_kernels()
    assert module is not None, "quantized kernels need the native kernels"
    return int(module.quant_amx_min_rows())


def quant_linear_reference(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, quantized: bool
) -> torch.Tensor:
    """float32 `x @ W.T + bias` as the kernel computes it (`quantized`: with the activations
    rounded as the VNNI path rounds them)."""
    x = quantize_activations_reference(x) if quantized else x.float()
    out = x @ dequantize(weight).T
    return out if bias is None else out + bias.float()


def native_quant_linear(weight: PackedWeight) -> Any:
    """The packed weight as the native `PackedLinear` (what a layer calls, and the fused
    decoder stack multiplies)."""
    module = native_kernels()
    assert module is not None, "quantized kernels need the native kernels"
    return module.PackedLinear.quantized(
        weight.codes,
        weight.scales,
        weight.offsets,
        weight.bits,
        weight.group_size,
        weight.out_features,
        weight.in_features,
    )


def quant_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` on the native kernels for 2-D float32 or bfloat16 `x` (tests; a layer
    holds its `native_quant_linear` and calls it)."""
    return native_quant_linear(weight).forward(x, bias, False)


def dense_bf16_reference(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """float32 product of what the AMX path multiplies: bfloat16 `x` and weights."""
    out = x.to(torch.bfloat16).float() @ dequantize(weight).to(torch.bfloat16).float().T
    return out if bias is None else out + bias.float()


def kernel_reference(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """float32 `x @ W.T + bias` as the kernels compute it at the ISA level in use."""
    if on_amx_tiles(x.shape[0]):
        return dense_bf16_reference(x, weight, bias)
    return quant_linear_reference(x, weight, bias, activations_quantized(x.shape[0]))
