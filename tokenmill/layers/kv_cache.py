"""The KV cache tensors: layout, storage dtype (incl. FP8) and how values go in and out
(how many blocks the engine gets: `core/kv/sizing.py`).

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

import math
import mmap
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
        values, and an uninitialised NaN there would poison the whole row. In host memory
        (unpinned) the zeros are the OS's own (`lazily_zeroed`): resident only once used."""
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if device.type == "cpu" and not pin:
            return [lazily_zeroed(shape, self.dtype) for _ in range(self.num_layers)]
        return [
            torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin)
            for _ in range(self.num_layers)
        ]


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor over an anonymous memory mapping: the kernel supplies zero pages
    on first touch, so a large KV cache costs resident memory only for the blocks written
    (`torch.zeros` writes every byte, making the whole budget resident at start)."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, num_bytes)  # private and anonymous: zero-filled, lazily
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv: torch.Tensor) -> None:
    """Store a step's keys and values, `[num_tokens, 2, kv_heads, head_dim]`, at their slots
    of one layer's `[2, num_blocks, block_size, kv_heads, head_dim]` cache (both in one
    copy), quantizing for FP8 storage."""
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    kv = kv.transpose(0, 1)
    if is_fp8(kv_cache.dtype):
        limit = torch.finfo(kv_cache.dtype).max
        quantized = kv.clamp(-limit, limit).to(kv_cache.dtype)
        # index_copy_ has no FP8 kernel on CPU; the bytes are copied as uint8 instead.
        flat.view(torch.uint8).index_copy_(1, slot_mapping, quantized.view(torch.uint8))
    else:
        flat.index_copy_(1, slot_mapping, kv)


def read_kv(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's keys and values, each `[num_seqs, kv_heads, max_blocks * block_size,
    head_dim]` in the compute dtype. One gather for both: on the CPU, index_select along the
    block dimension of the whole layer was 10x faster than two along dim 0 of K and V."""
    num_seqs, max_blocks = block_tables.shape
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    gathered = kv_cache.index_select(1, block_tables.flatten())
    gathered = gathered.view(2, num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    if gathered.dtype != dtype:
        gathered = gathered.to(dtype)
    keys, values = gathered.transpose(2, 3).unbind(0)
    return keys, values


def swap_blocks(
    pairs: list[tuple[int, int]], sources: list[torch.Tensor], destinations: list[torch.Tensor]
) -> None:
    """Copy whole blocks (source id, destination id) between the device cache and the host
    swap pool, layer by layer."""
    if not pairs:
        return
    source_ids = torch.tensor([p[0] for p in pairs])
    destination_ids = torch.tensor([p[1] for p in pairs])
    for source, destination in zip(sources, destinations, strict=True):
        blocks = source[:, source_ids.to(source.device)]
        destination[:, destination_ids.to(destination.device)] = blocks.to(destination.device)
