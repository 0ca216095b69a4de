"""llama.cpp's quantized blocks into the engine's int4 layout, or into floats.

Q4_0 (32 weights: an fp16 `d`, 16 bytes of nibbles; w = d * (q - 8)) and Q4_K (256 weights in
8 groups of 32: fp16 `d` and `dmin`, 6-bit scale and min per group; w = d * sc * q - dmin * m)
are both `(q - 8) * scale + zero` over groups of 32, the int4 kernel's own form. Other types
are dequantized with the gguf package's reference code (`gguf.quants.dequantize`).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from tokenmill.layers.int4_linear import Int4GroupWeight

INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_K)
_Q4_0_BLOCK_BYTES = 18
_Q4_K_BLOCK_BYTES = 144


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Any type the gguf package reads, as float32 `[rows, cols]`."""
    # A copy: F32 tensors come back as views of the read-only memory map.
    return torch.from_numpy(np.array(quants.dequantize(data, qtype), dtype=np.float32))


def int4_groups(data: np.ndarray, qtype: GGMLQuantizationType) -> Int4GroupWeight:
    """A Q4_0 or Q4_K tensor's rows (`data`: uint8 `[rows, bytes per row]`) as int4 groups
    of 32."""
    if qtype == GGMLQuantizationType.Q4_0:
        return _q4_0(data)
    if qtype == GGMLQuantizationType.Q4_K:
        return _q4_k(data)
    raise ValueError(f"{qtype.name} has no int4 form")


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`[..., 16]` bytes -> `[..., 32]` values: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(data: np.ndarray) -> Int4GroupWeight:
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, _Q4_0_BLOCK_BYTES)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    values = _nibbles(blocks[..., 2:]).reshape(rows, -1)
    return Int4GroupWeight(
        torch.from_numpy(values.copy()),
        torch.from_numpy(scales),
        torch.zeros(scales.shape, dtype=torch.float32),
    )


def _q4_k(data: np.ndarray) -> Int4GroupWeight:
    rows = data.shape[0]
    blocks = data.reshape(-1, _Q4_K_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    # 128 bytes: 4 chunks of 32 bytes, each the low nibbles of group 2c and the high of 2c+1.
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    values = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    scale = d * sc.astype(np.float32)
    zero = 8 * scale - dmin * m.astype(np.float32)
    return Int4GroupWeight(
        torch.from_numpy(values.reshape(rows, -1).copy()),
        torch.from_numpy(scale.reshape(rows, -1)),
        torch.from_numpy(zero.reshape(rows, -1)),
    )
