"""Quantized linears on the native kernels (`csrc/int_linear.h`): the packed layout they
stream, packing into it at load time, and a torch reference of what they compute.

A weight arrives as signed integer codes with a float scale (and optionally an offset) per
group of `group_size` input columns: W = code * scale + offset. It is packed once:

- output rows in blocks of 16; in each block the codes of 4 consecutive input columns of the
  16 rows share 64 bytes (int8, one code + 128 per byte) or those of 8 columns do (int4, code
  + 8 per nibble: byte j of a row's 4 bytes holds column j low and column 4 + j high). One
  vector load then feeds a VNNI dot product for all 16 rows, and a block streams front to back
  (llama.cpp repacks its blocks into interleaved rows for the same reason);
- 2- and 3-bit codes (GGUF's Q2_K and Q3_K at their own width): bit pairs instead of nibbles,
  byte j of a row's 4 bytes holding columns j, 4 + j, 8 + j and 12 + j of a 16-column chunk,
  and a 3-bit code's high bit as a mask like the 5- and 6-bit codes' below;
- 5-bit codes (GGUF's Q5_0 and Q5_K at their own width, code + 16): the int4 layout of their
  low four bits, then in the same block their high bits as bit masks, one pair of 64-bit masks
  per 8 columns (the chunk's low nibbles, then its high ones; bit b for byte b of the chunk's
  64), which the kernels add back with masked byte adds;
- 6-bit codes (GGUF's Q6_K, code + 32): the int4 layout of their low four bits, then in the
  same block their two high bits in the 2-bit codes' layout (64 bytes per 16 columns: byte j
  of a row's 4 holds the high pairs of columns j, 4 + j, 8 + j and 12 + j), which a shift and
  a mask put back beside each nibble (two masks per 8 columns cost AVX2 ~10 instructions per
  vector where this costs 2: it halved the speed of Q6_K products there);
- codes from a table (`codebook`: GGUF's IQ4_NL / IQ4_XS, whose 4-bit indices pick one of 16
  int8 values): the int4 layout of the indices; the kernels look the values up;
- scales and offsets as float16 `[blocks, groups, 16]`, 16 consecutive rows per load; or,
  where every super-block of 256 columns of a row has its scales as a float16 times small
  integers (GGUF's K-quants and IQ4_XS: `d * sc`), the scales factored back into those int8
  integers per group and float16 per super-block (`factor_scales`): the file's scale bytes,
  not 16 bits a group (a 1B Q4_K_M file's weights held at its size, not ~10 % above).

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
# The ISA levels (tokenmill/kernels/native.py's ISA_LEVELS) whose kernels multiply float
# activations: portable and avx512 (no VNNI). The others quantize them to int8: avx2
# (vpmaddubsw, as llama.cpp's AVX2 dot products) and avx512_bf16 and up (VNNI). And the level
# whose AMX tiles take products of many rows (csrc/int_linear.h).
FLOAT_ACTIVATIONS_LEVELS = (ISA_LEVELS.index("portable"), ISA_LEVELS.index("avx512"))
AMX_LEVEL = ISA_LEVELS.index("amx")
# Code widths with a packed layout; codes are stored unsigned, plus 2 ** (bits - 1).
CODE_BITS = (8, 6, 5, 4, 3, 2)
# Widths whose codes carry high bits as masks after their base (nibbles, or bit pairs).
_MASKED_BITS = (5, 3)
# Width whose codes carry their two high bits as bit pairs after their nibbles.
_PAIRED_BITS = 6
# llama.cpp's IQ4_NL table (IQ4_XS's too): the int8 values a 4-bit index stands for, and the
# `bits` the native kernels take for such codes (csrc/int_linear.h's kIq4NlBits).
IQ4_NL_VALUES = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.int8
)
IQ4_NL_BITS = 14
_BIT_WEIGHTS = 1 << torch.arange(8)
# Columns per factored scale's float16 part (csrc/int_linear.h's kSuperCols), and the integer
# a super-block's largest scale is tried as (K-quants put it at their scale's extreme, of
# either sign: llama.cpp's Q6_K / Q3_K / IQ4_XS make it -128 / -32 with `d` of either sign).
SUPER_COLS = 256
_LARGEST_SUB_SCALES = (127, -128, 63, 64, -64, 31, -32, 15, 16)


def code_range(bits: int) -> tuple[int, int]:
    """The signed codes a width holds: (-2 ** (bits - 1), 2 ** (bits - 1) - 1)."""
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


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
    codebook: torch.Tensor | None = None  # int8 [16]: the value of each 4-bit index
    # Factored scales: `scales` int8 [blocks, groups, 16] times these [blocks, supers, 16].
    super_scales: torch.Tensor | None = None

    @property
    def padded_in(self) -> int:
        return self.scales.shape[1] * self.group_size


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
    codebook: torch.Tensor | None = None,
) -> PackedWeight:
    """Pack signed `codes` `[out, in]` (within `code_range(bits)`) with `scales` (and
    `offsets`) `[out, groups]`; `group_size` None means one scale per row. With a `codebook`
    (int8 `[16]`, 4 bits) the codes are values of the table, packed as their indices."""
    if bits not in CODE_BITS:
        raise ValueError(f"{bits}-bit codes have no packed layout")
    if codebook is not None:
        codes = codebook_indices(codes, codebook) + code_range(4)[0]
    rows, cols = codes.shape
    width, group = padded_width(cols, group_size)
    blocks = -(-rows // BLOCK_ROWS)
    padded = torch.zeros(blocks * BLOCK_ROWS, width, dtype=torch.int16)
    padded[:rows, :cols] = codes.to(torch.int16)
    unsigned = (padded - code_range(bits)[0]).to(torch.uint8)
    if bits == 8:
        lanes = unsigned.view(blocks, BLOCK_ROWS, width // 4, 4)
        packed_codes = lanes.permute(0, 2, 1, 3).contiguous().view(blocks, -1)
    elif bits < 4:
        packed_codes = _pair_lanes(unsigned, blocks)
    else:
        nibbles = (unsigned & 0x0F).view(blocks, BLOCK_ROWS, width // 8, 2, 4)
        lanes = nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)
        packed_codes = lanes.permute(0, 2, 1, 3).contiguous().view(blocks, -1)
    if bits in _MASKED_BITS:
        packed_codes = torch.cat([packed_codes, _high_bit_masks(unsigned, bits, blocks)], dim=1)
    elif bits == _PAIRED_BITS:
        packed_codes = torch.cat([packed_codes, _pair_lanes(unsigned >> 4, blocks)], dim=1)
    factored = factor_scales(scales, group) if width == cols else None
    if factored is None:
        packed_scales, super_scales = _pack_groups(scales, blocks), None
    else:
        packed_scales = _pack_groups(factored[0], blocks, torch.int8)
        super_scales = _pack_groups(factored[1], blocks)
    return PackedWeight(
        packed_codes,
        packed_scales,
        None if offsets is None else _pack_groups(offsets, blocks),
        bits,
        group,
        rows,
        cols,
        codebook,
        super_scales,
    )


def factor_scales(
    scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`scales` `[rows, groups]` as int8 `[rows, groups]` times float16 `[rows, supers]` (one
    per SUPER_COLS columns), exactly, or None where some super-block's are not (scales of
    other origins than a K-quant's `d * sc`; a width not in whole super-blocks)."""
    rows, groups = scales.shape
    if SUPER_COLS % group_size or (groups * group_size) % SUPER_COLS:
        return None
    grouped = scales.float().reshape(-1, SUPER_COLS // group_size)  # [rows * supers, per]
    # The step takes the largest scale's sign: a sub-scale of -128 needs a step of its sign.
    signed = _signed_largest(grouped)
    steps = torch.zeros_like(signed)
    left = torch.nonzero(signed != 0).flatten()  # all-zero super-blocks: any step
    # The extremes first (where llama.cpp's quantizers put the largest), then every other
    # integer; on the first few super-blocks before all of them, so that scales of no K-quant
    # (Q8_0's, online quantization's) are turned down at the cost of those few.
    others = [k for k in range(1, 129) if k not in _LARGEST_SUB_SCALES]
    candidates = (*_LARGEST_SUB_SCALES, *others, *(-k for k in others))
    probe = left[:64]
    if len(_factor_into(steps, grouped, signed, probe, candidates)):
        return None
    found = signed == 0
    found[probe] = True
    # The probe's commonest integer first (a file's quantizer puts its largest at one place).
    usual = torch.round(signed[probe] / steps[probe]).mode().values.item() if len(probe) else 63
    order = (int(usual), *(k for k in _LARGEST_SUB_SCALES if k != int(usual)))
    for candidate in order:  # on whole tensors: most super-blocks end here
        step = (signed / candidate).half().float()
        subs = torch.round(grouped / torch.where(step == 0, 1.0, step)[:, None])
        exact = ((subs * step[:, None] == grouped) & (subs >= -128) & (subs <= 127)).all(-1)
        take = exact & ~found & (step != 0)
        steps = torch.where(take, step, steps)
        found |= take
        if bool(found.all()):
            break
    rest = torch.nonzero(~found).flatten()
    if len(_factor_into(steps, grouped, signed, rest, candidates)):
        return None
    subs = torch.round(grouped / torch.where(steps == 0, 1.0, steps)[:, None])
    return subs.to(torch.int8).view(rows, groups), steps.half().view(rows, -1)


def _factor_into(
    steps: torch.Tensor,
    grouped: torch.Tensor,
    signed: torch.Tensor,
    left: torch.Tensor,
    candidates: tuple[int, ...] | list[int],
) -> torch.Tensor:
    """Try each candidate integer for the largest scale of the super-blocks `left`, writing
    the steps that factor exactly into `steps`; returns the super-blocks still left."""
    for candidate in candidates:
        if len(left) == 0:
            break
        step = (signed[left] / candidate).half().float()
        part = grouped[left]
        subs = torch.round(part / torch.where(step == 0, 1.0, step)[:, None])
        exact = (subs * step[:, None] == part) & (subs >= -128) & (subs <= 127)
        exact = exact.all(-1) & (step != 0)
        steps[left[exact]] = step[exact]
        left = left[~exact]
    return left


def codebook_indices(values: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Each int8 value's index in `codebook` (a table of 16 distinct values), int16."""
    if codebook.shape != (16,) or len(set(codebook.tolist())) != 16:
        raise ValueError("a codebook is 16 distinct int8 values")
    inverse = torch.full((256,), -1, dtype=torch.int16)
    inverse[codebook.to(torch.int64) + 128] = torch.arange(16, dtype=torch.int16)
    indices = inverse[values.to(torch.int64) + 128]
    if (indices < 0).any():
        raise ValueError("codes outside the codebook's values")
    return indices


def _pair_lanes(unsigned: torch.Tensor, blocks: int) -> torch.Tensor:
    """The low two bits of `unsigned` `[blocks * 16, width]` as bit pairs (module docstring):
    byte j of a row's 4 per 16 columns holds columns j, 4 + j, 8 + j and 12 + j, uint8
    `[blocks, width * 4]`."""
    width = unsigned.shape[1]
    pairs = (unsigned & 0x03).view(blocks, BLOCK_ROWS, width // 16, 4, 4).to(torch.uint8)
    lanes = pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 2)
    lanes = lanes | (pairs[:, :, :, 2] << 4) | (pairs[:, :, :, 3] << 6)
    return lanes.permute(0, 2, 1, 3).contiguous().view(blocks, -1)


def _high_bit_masks(unsigned: torch.Tensor, bits: int, blocks: int) -> torch.Tensor:
    """The high bits of 3- / 5-bit codes as the kernels' masks (module docstring), uint8
    `[blocks, chunks * (bits - 4) * 16]`."""
    width = unsigned.shape[1]
    # [blocks, rows, chunks, half (columns 0-3 / 4-7), j]
    base = _base_bits(bits)
    high = (unsigned >> base).view(blocks, BLOCK_ROWS, width // 8, 2, 4)
    planes = torch.stack([(high >> h) & 1 for h in range(bits - base)], dim=2)
    # -> [blocks, chunks, plane, half, rows * 4 + j]: bit b of a mask is byte b of the chunk.
    mask_bits = planes.permute(0, 3, 2, 4, 1, 5).reshape(blocks, -1, 8, 8)
    return (mask_bits.to(torch.int32) * _BIT_WEIGHTS).sum(-1).to(torch.uint8).view(blocks, -1)


def _signed_largest(grouped: torch.Tensor) -> torch.Tensor:
    """Each super-block's scale of the largest magnitude, with its sign."""
    index = grouped.abs().argmax(dim=-1, keepdim=True)
    return grouped.gather(-1, index).squeeze(-1)


def _base_bits(bits: int) -> int:
    """Bits of a code in its chunk's base layout: bit pairs below 4 bits, else nibbles."""
    return 2 if bits < 4 else 4


def _pack_groups(
    values: torch.Tensor, blocks: int, dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    rows, groups = values.shape
    padded = torch.zeros(blocks * BLOCK_ROWS, groups, dtype=dtype)
    padded[:rows] = values.to(dtype)
    return padded.view(blocks, BLOCK_ROWS, groups).transpose(1, 2).contiguous()


def packed_rows(weight: PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """The dequantized float32 rows `rows` (output rows: an embedding's tokens) of a packed
    weight, `[len(rows), in_features]`."""
    block, lane = rows // BLOCK_ROWS, rows % BLOCK_ROWS
    width, bits = weight.padded_in, weight.bits
    # The rows' blocks first, then their lanes: unpacking the whole table (a tied LM head's
    # vocabulary) per lookup cost a 1B model's decode step ~300 ms.
    # index_select: `codes[block]` runs torch's parallel index kernel, ~25 ms a lookup when
    # the kernels' own worker threads hold the cores (measured on 2 busy cores).
    codes = weight.codes.index_select(0, block)  # [n, block bytes]
    picked_rows = torch.arange(len(rows))
    if bits == 8:
        lanes = codes.view(-1, width // 4, BLOCK_ROWS, 4)[picked_rows, :, lane]
        unsigned = lanes.reshape(len(rows), width).to(torch.int16)
    else:
        base = _base_bits(bits)
        base_bytes = BLOCK_ROWS * width * base // 8
        if base == 2:
            unsigned = _picked_pairs(codes[:, :base_bytes], picked_rows, lane, width)
        else:
            lanes = codes[:, :base_bytes].reshape(-1, width // 8, BLOCK_ROWS, 4)
            lanes = lanes[picked_rows, :, lane]
            nibbles = torch.stack([lanes & 0x0F, lanes >> 4], dim=2)  # [n, width/8, 2, 4]
            unsigned = nibbles.to(torch.int16)
        if bits in _MASKED_BITS:
            planes = bits - base
            masks = codes[:, base_bytes:].reshape(-1, width // 8, planes, 2, 8)
            # Bit lane * 4 + j of a mask is the row's column j: byte lane // 2, from bit
            # 4 * (lane % 2). Only the rows' bytes are expanded (a step's cost, not a block's).
            picked_bytes = masks[picked_rows, :, :, :, lane // 2].to(torch.int16)
            shifts = (4 * (lane % 2)).view(-1, 1, 1, 1, 1) + torch.arange(4)
            # [n, chunks, plane, half, j] -> each plane's bit onto the base codes
            picked = (picked_bytes[..., None] >> shifts) & 1
            for h in range(planes):
                unsigned = unsigned + (picked[:, :, h] << (base + h))
        elif bits == _PAIRED_BITS:
            high = _picked_pairs(codes[:, base_bytes:], picked_rows, lane, width)
            unsigned = unsigned + (high << 4)
        unsigned = unsigned.reshape(len(rows), width)
    if weight.codebook is None:
        codes = unsigned - (1 << (bits - 1))
    else:
        codes = weight.codebook.to(torch.int16)[unsigned.long()]
    scales = weight.scales[block, :, lane].float()
    if weight.super_scales is not None:
        per_super = SUPER_COLS // weight.group_size
        supers = weight.super_scales[block, :, lane].float()
        scales = scales * supers.repeat_interleave(per_super, dim=1)
    grouped = codes.float().view(len(rows), -1, weight.group_size) * scales[..., None]
    if weight.offsets is not None:
        grouped = grouped + weight.offsets[block, :, lane].float()[..., None]
    return grouped.view(len(rows), width)[:, : weight.in_features]


def _picked_pairs(
    codes: torch.Tensor, picked_rows: torch.Tensor, lane: torch.Tensor, width: int
) -> torch.Tensor:
    """The bit pairs (`_pair_lanes`) of lane `lane` of each of `codes`' blocks, int16
    `[n, width / 8, 2, 4]` (chunk, its low / high nibble's columns, j)."""
    lanes = codes.reshape(-1, width // 16, BLOCK_ROWS, 4)[picked_rows, :, lane]
    pairs = torch.stack([(lanes >> (2 * i)) & 3 for i in range(4)], dim=2)
    return pairs.to(torch.int16).reshape(len(picked_rows), width // 8, 2, 4)


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
    the ISA level in use, AVX2's or VNNI's (AVX512_BF16 and up), below the AMX path's rows."""
    module = native_kernels()
    if module is None or module.get_isa() in FLOAT_ACTIVATIONS_LEVELS:
        return False
    return not on_amx_tiles(rows)


def activation_level(best: int, quantized: bool) -> int | None:
    """The highest ISA level up to `best` whose kernels multiply int8 (`quantized`) or float
    activations; None where there is none."""
    levels = [
        level for level in range(best + 1) if (level not in FLOAT_ACTIVATIONS_LEVELS) == quantized
    ]
    return levels[-1] if levels else None


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
    if weight.codebook is not None and not torch.equal(weight.codebook, IQ4_NL_VALUES):
        raise ValueError("the native kernels take one codebook: IQ4_NL's values")
    return module.PackedLinear.quantized(
        weight.codes,
        weight.scales,
        weight.offsets,
        weight.bits if weight.codebook is None else IQ4_NL_BITS,
        weight.group_size,
        weight.out_features,
        weight.in_features,
        weight.super_scales,
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
