"""The KV cache tensors: layout, storage dtype (incl. FP8) and how values go in and out
(how many blocks the engine gets: `engine/kv_sizing.py`).

Layout per layer: `[2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]`.

FP8 storage uses one scale per tensor (per layer, for keys and for values), fixed at 1.0 as
vLLM does for checkpoints without calibrated scales, with values saturated at the format's
range. Why per tensor: a block's bytes are then exactly half a 16-bit block's (a quarter of a
float32 one), so the memory budget buys exactly 2x (4x) the blocks; and FP8 is a floating-point
format, whose relative precision does not depend on the scale as long as values stay in range,
which K/V activations of Llama-family models do (e4m3 reaches 448, e5m2 57344). Finer scales
(per token and head) would buy accuracy only for outliers, at the cost of scale storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # storage dtype

    @property
    def bytes_per_block(self) -> int:
        elements = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        return elements * self.dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device, pin: bool = False) -> list:
        """Zeroed, not empty: attention multiplies masked-out (zero-weight) slots by their
        values, and an uninitialised NaN there would poison the whole row."""
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [
            torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin)
            for _ in range(self.num_layers)
        ]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Store `[num_tokens, kv_heads, head_dim]` values at their slots of a
    `[num_blocks, block_size, kv_heads, head_dim]` cache, quantizing for FP8 storage."""
    flat = cache.view(-1, *cache.shape[2:])
    if is_fp8(cache.dtype):
        limit = torch.finfo(cache.dtype).max
        quantized = values.clamp(-limit, limit).to(cache.dtype)
        # index_copy_ has no FP8 kernel on CPU; the bytes are copied as uint8 instead.
        flat.view(torch.uint8).index_copy_(0, slot_mapping, quantized.view(torch.uint8))
    else:
        flat.index_copy_(0, slot_mapping, values)


def read_kv(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each sequence's context: `[num_seqs, kv_heads, max_blocks * block_size, head_dim]` in the
    compute dtype."""
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    # index_select, not cache[block_tables]: the same copy, 4x faster on CPU.
    gathered = cache.index_select(0, block_tables.flatten())
    gathered = gathered.view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    if gathered.dtype != dtype:
        gathered = gathered.to(dtype)
    return gathered.transpose(1, 2)
