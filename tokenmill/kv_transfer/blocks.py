"""Whole KV blocks in and out of the paged cache, as one contiguous payload: what a connector
stores, loads or sends.

A payload is uint8 `[num_layers, 2, num_blocks, block_size, kv_heads, head_bytes]`
(`head_bytes`: head_dim times the cache dtype's size, FP8 included), so the same bytes move
whatever the cache's dtype, and block `i` of it is `payload[:, :, i]`.
"""

from __future__ import annotations

import torch

from tokenmill.layers.kv_cache import KVCacheSpec


def block_shape(spec: KVCacheSpec) -> tuple[int, int, int, int, int]:
    """One block's bytes: `[num_layers, 2, block_size, kv_heads, head_bytes]`."""
    head_bytes = spec.head_dim * spec.dtype.itemsize
    return (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, head_bytes)


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """A copy of the blocks' KV, on the caches' device."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    return torch.stack([cache.view(torch.uint8)[:, ids] for cache in kv_caches])


def scatter_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], payload: torch.Tensor
) -> None:
    """Write `payload` (from `gather_blocks`, any device) into the blocks `block_ids`."""
    device = kv_caches[0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    payload = payload.to(device)
    for layer, cache in enumerate(kv_caches):
        cache.view(torch.uint8)[:, ids] = payload[layer]
