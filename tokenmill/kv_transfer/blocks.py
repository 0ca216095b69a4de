"""Whole KV blocks in and out of the paged cache, as one contiguous payload: what a connector
stores, loads or sends.

A payload is uint8 `[num_layers, 2, num_blocks, block_size, kv_heads, head_bytes]`
(`head_bytes`: head_dim times the cache dtype's size, FP8 included), so the same bytes move
whatever the cache's dtype, and block `i` of it is `payload[:, :, i]`.
"""

from __future__ import annotations

import math
import zlib

import torch

from tokenmill.layers.kv_cache import KVCacheSpec


def block_shape(spec: KVCacheSpec) -> tuple[int, int, int, int, int]:
    """One block's bytes: `[num_layers, 2, block_size, kv_heads, head_bytes]`."""
    head_bytes = spec.head_dim * spec.dtype.itemsize
    return (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, head_bytes)


def payload_shape(kv_caches: list[torch.Tensor], num_blocks: int) -> tuple[int, ...]:
    """The payload of `num_blocks` blocks of these caches (`[2, blocks, block_size, heads,
    head_dim]` per layer)."""
    cache = kv_caches[0]
    head_bytes = cache.shape[-1] * cache.element_size()
    return (len(kv_caches), 2, num_blocks, cache.shape[2], cache.shape[3], head_bytes)


def gather_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """A copy of the blocks' KV on the caches' device, written into `out` if given (a
    `payload_shape` tensor there)."""
    device = kv_caches[0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    if out is None:
        out = torch.empty(
            payload_shape(kv_caches, len(block_ids)), dtype=torch.uint8, device=device
        )
    for layer, cache in enumerate(kv_caches):
        torch.index_select(cache.view(torch.uint8), 1, ids, out=out[layer])
    return out


def scatter_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], payload: torch.Tensor
) -> None:
    """Write `payload` (from `gather_blocks`, any device) into the blocks `block_ids`."""
    device = kv_caches[0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    payload = payload.to(device)
    for layer, cache in enumerate(kv_caches):
        cache.view(torch.uint8).index_copy_(1, ids, payload[layer])


class StagingBuffer:
    """One buffer, reused, for the payloads of a transfer moved chunk by chunk. Memory a
    process has not touched yet is slow to fault in (on a VM measured at ~20 us a page: 2 s
    for a 184 MB payload, as long as the whole transfer should take), so a connection
    allocates its largest chunk once and reuses it."""

    def __init__(self, device: torch.device) -> None:
        self._flat = torch.empty(0, dtype=torch.uint8, device=device)

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A `shape` uint8 tensor over the buffer (grown if it is smaller); its contents are
        whatever the last user left."""
        num_bytes = math.prod(shape)
        if self._flat.numel() < num_bytes:
            self._flat = torch.empty(num_bytes, dtype=torch.uint8, device=self._flat.device)
        return self._flat[:num_bytes].view(shape)


def block_crcs(payload: torch.Tensor) -> list[int]:
    """CRC-32 of each block of a CPU payload `[layers, 2, blocks, ...]`: its bytes in (layer,
    K/V) order, read in place (a block is not contiguous in the payload; a copy of each
    would fault in fresh memory for every block)."""
    array = payload.numpy()
    layers, kv, num_blocks = array.shape[:3]
    crcs = []
    for index in range(num_blocks):
        crc = 0
        for layer in range(layers):
            for half in range(kv):
                crc = zlib.crc32(array[layer, half, index], crc)
        crcs.append(crc)
    return crcs
