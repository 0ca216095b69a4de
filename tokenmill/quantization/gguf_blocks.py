"""llama.cpp's quantized blocks as the engine's int8 and int4 groups, or as floats.

Every type read here is `code * scale + offset` over groups along a row, so its blocks go into
the engine's layouts as they are (only the scales rounded to float16):

- Q4_0 (32 weights: fp16 `d`, 16 bytes of nibbles; w = d * (q - 8)) and Q4_K (256 weights in 8
  groups of 32: fp16 `d` and `dmin`, a 6-bit scale and min per group; w = d * sc * q - dmin *
  m): int4 groups of 32.
- Q8_0 (fp16 `d`, 32 int8): int8 groups of 32; Q5_0 (fp16 `d`, 32 fifth bits, 16 bytes of
  nibbles; w = d * (q - 16)) and Q5_K (Q4_K's scales with a fifth bit per weight): 5-bit
  groups of 32 (codes -16..15, decoded here as int8 and packed at 5 bits).
- Q6_K (256 weights: 128 bytes of low nibbles, 64 of high bit pairs, an int8 scale per 16, fp16
  `d`; w = d * sc * (q - 32)): 6-bit groups of 16.
- Q3_K (256 weights in 16 groups: 2 low bits and a high bit per weight, 6-bit signed scales;
  w = d * (sc - 32) * q, q in -4..3) and Q2_K (2 bits per weight, a 4-bit scale and min per
  group of 16; w = d * sc * q - dmin * m): 3- and 2-bit groups of 16 (codes q and q - 2).
- IQ4_NL (32 weights: fp16 `d`, 4-bit indices into a table of 16 int8 values) and IQ4_XS (256
  weights: fp16 `d`, a 6-bit scale per 32, the same indices): groups of 32 of the table's
  values, which the kernels hold as the indices (`kernels/int_linear.py`'s codebook).

Other types are dequantized with the gguf package's reference code (`gguf.quants.dequantize`).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from tokenmill.quantization.int4 import Int4GroupWeight
from tokenmill.quantization.int8 import Int8GroupWeight

Q = GGMLQuantizationType
INT4_TYPES = (Q.Q4_0, Q.Q4_K, Q.Q3_K, Q.Q2_K)
INT8_TYPES = (Q.Q8_0, Q.Q5_0, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
# Types whose codes are values of llama.cpp's IQ4_NL table (held as 4-bit indices alone).
IQ4_TYPES = (Q.IQ4_NL, Q.IQ4_XS)
# The width of each type's codes (5- and 6-bit ones are packed at it: kernels/int_linear.py;
# IQ4 values are int8 wherever they share a layer with another type).
CODE_BITS = {
    **{Q.Q4_0: 4, Q.Q4_K: 4, Q.Q3_K: 3, Q.Q2_K: 2, Q.Q5_0: 5, Q.Q5_K: 5, Q.Q6_K: 6},
    **{Q.Q8_0: 8, Q.IQ4_NL: 8, Q.IQ4_XS: 8},
}
# Columns per scale of each type (its int8/int4 group size).
GROUP_SIZE = {
    **{Q.Q4_0: 32, Q.Q4_K: 32, Q.Q8_0: 32, Q.Q5_0: 32, Q.Q5_K: 32, Q.Q6_K: 16},
    **{Q.Q3_K: 16, Q.Q2_K: 16, Q.IQ4_NL: 32, Q.IQ4_XS: 32},
}
_BLOCK_BYTES = {
    **{Q.Q4_0: 18, Q.Q4_K: 144, Q.Q8_0: 34, Q.Q5_0: 22, Q.Q5_K: 176, Q.Q6_K: 210},
    **{Q.Q3_K: 110, Q.Q2_K: 84, Q.IQ4_NL: 18, Q.IQ4_XS: 136},
}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Any type the gguf package reads, as float32 `[rows, cols]`."""
    # A copy: F32 tensors come back as views of the read-only memory map.
    return torch.from_numpy(np.array(quants.dequantize(data, qtype), dtype=np.float32))


def groups(data: np.ndarray, qtype: GGMLQuantizationType) -> Int4GroupWeight | Int8GroupWeight:
    """A tensor of one of INT4_TYPES or INT8_TYPES (`data`: uint8 `[rows, bytes per row]`) as
    the engine's groups."""
    rows = data.shape[0]
    values, scales, offsets = _DECODERS[qtype](data.reshape(-1, _BLOCK_BYTES[qtype]))
    values, scales = _rows(values, rows), _rows(scales, rows)
    if qtype in INT4_TYPES:
        return Int4GroupWeight(values, scales, _rows(offsets, rows))
    return Int8GroupWeight(values, scales, None if offsets is None else _rows(offsets, rows))


def _rows(array: np.ndarray, rows: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array).reshape(rows, -1))


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of each block, as float32 `[blocks, 1]`."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`[..., n]` bytes -> `[..., 2n]` values: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# Each decoder: blocks `[n, bytes]` -> (codes, scales, offsets) per block: int4 types give
# values 0..15 with zeros (Int4GroupWeight's form: (value - 8) * scale + zero), int8 types
# signed codes.
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _q4_0(blocks: np.ndarray) -> Decoded:
    scales = _half(blocks, 0)
    return _nibbles(blocks[:, 2:]), scales, np.zeros_like(scales)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (scale, min) of each group of 32, float32 `[blocks, 8]`."""
    sc, m = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    return _half(blocks, 0) * sc.astype(np.float32), _half(blocks, 2) * m.astype(np.float32)


def _q4_k(blocks: np.ndarray) -> Decoded:
    scale, low = _k_scales(blocks)
    # 128 bytes: 4 chunks of 32 bytes, each the low nibbles of group 2c and the high of 2c+1.
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    values = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    return values, scale, 8 * scale - low


def _q8_0(blocks: np.ndarray) -> Decoded:
    return blocks[:, 2:].copy().view(np.int8), _half(blocks, 0), None


def _fifth_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit i of each row of `qh` for i < count, as uint8 0/1."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[:, :count]


def _q5_0(blocks: np.ndarray) -> Decoded:
    q = _nibbles(blocks[:, 6:]) | (_fifth_bits(blocks[:, 2:6], 32) << 4)
    return q.astype(np.int8) - 16, _half(blocks, 0), None


def _q5_k(blocks: np.ndarray) -> Decoded:
    scale, low = _k_scales(blocks)
    qs = blocks[:, 48:].reshape(-1, 4, 32)
    low_bits = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    # qh: 32 bytes; bit g of byte j is the fifth bit of weight j of group g.
    high = (blocks[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [blocks, 32, 8]
    q = low_bits | (high.transpose(0, 2, 1) << 4)
    codes = q.reshape(-1, 256).astype(np.int8) - 16
    return codes, scale, 16 * scale - low


def _q6_k(blocks: np.ndarray) -> Decoded:
    # Two halves of 128 weights; in each, ql's 64 bytes give weights 0-63 (low nibbles) and
    # 64-127 (high), qh's 32 bytes give bit pairs 0-1, 2-3, 4-5, 6-7 for weights l + 32 i.
    ql = blocks[:, :128].reshape(-1, 2, 64)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [blocks, 2, 128]
    high = (qh & 0x03).reshape(-1, 2, 128)
    codes = (low | (high << 4)).reshape(-1, 256).astype(np.int8) - 32
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    return codes, _half(blocks, 208) * sc, None


def _q3_k(blocks: np.ndarray) -> Decoded:
    # hmask 32 bytes (bit i of byte l: weight 32 i + l's high bit), qs 64 (two halves of 32
    # bytes, bit pair i of byte l: weight 128 h + 32 i + l), 12 bytes of 6-bit scales, fp16 d.
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    low = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    high = (hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [blocks, 8, 32]
    codes = low.reshape(-1, 256).astype(np.int8) + (high.reshape(-1, 256).astype(np.int8) - 1) * 4
    # Scale j: low nibble of byte j % 8 (the high nibble from j >= 8), top two bits from byte
    # 8 + j % 4 at bit 2 * (j // 4).
    j = np.arange(16)
    low_nibble = (packed[:, j % 8] >> (4 * (j // 8)).astype(np.uint8)) & 0x0F
    top = (packed[:, 8 + j % 4] >> (2 * (j // 4)).astype(np.uint8)) & 3
    sc = (low_nibble | (top << 4)).astype(np.float32) - 32
    scales = _half(blocks, 108) * sc
    return codes.astype(np.int16).astype(np.uint8) + 8, scales, np.zeros_like(scales)


def _q2_k(blocks: np.ndarray) -> Decoded:
    # 16 bytes of (scale | min << 4) per group of 16, qs 64 as Q3_K's, fp16 d and dmin.
    packed, qs = blocks[:, :16], blocks[:, 16:80]
    values = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    scale = _half(blocks, 80) * (packed & 0x0F).astype(np.float32)
    low = _half(blocks, 82) * (packed >> 4).astype(np.float32)
    # Codes q - 2 (-2..1, stored + 8 as int4 values): the offset is 2 x scale - dmin * m, not
    # 8 x scale minus it, whose float16 rounding would cost ~4x more.
    return values.reshape(-1, 256) + 6, scale, 2 * scale - low


_IQ4_VALUES = np.array(quants.IQ4_NL.kvalues, dtype=np.int8)


def _iq4_values(qs: np.ndarray) -> np.ndarray:
    """`[n, 16]` bytes of indices (low nibbles: weights 0-15, high: 16-31) -> int8 values."""
    return _IQ4_VALUES[_nibbles(qs)]


def _iq4_nl(blocks: np.ndarray) -> Decoded:
    return _iq4_values(blocks[:, 2:]), _half(blocks, 0), None


def _iq4_xs(blocks: np.ndarray) -> Decoded:
    # fp16 d, 2 bytes of the scales' top bit pairs, 4 of their low nibbles, 8 x 16 bytes of
    # indices; group g's scale: d * (ls - 32).
    high = blocks[:, 2:4].copy().view(np.uint16)  # [blocks, 1]
    g = np.arange(8)
    low_nibble = (blocks[:, 4 + g // 2] >> (4 * (g % 2)).astype(np.uint8)) & 0x0F
    top = ((high >> (2 * g).astype(np.uint16)) & 3).astype(np.uint8)
    ls = (low_nibble | (top << 4)).astype(np.float32) - 32
    values = _iq4_values(blocks[:, 8:].reshape(-1, 16)).reshape(-1, 256)
    return values, _half(blocks, 0) * ls, None


_DECODERS = {
    Q.Q4_0: _q4_0,
    Q.Q4_K: _q4_k,
    Q.Q8_0: _q8_0,
    Q.Q5_0: _q5_0,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.Q3_K: _q3_k,
    Q.Q2_K: _q2_k,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
}
