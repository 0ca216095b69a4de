"""The KV cache tensors: layout, size, storage dtype (incl. FP8) and how values go in and out.

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

from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError, EngineConfig

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


def num_kv_blocks(
    config: EngineConfig,
    spec: KVCacheSpec,
    max_model_len: int,
    device: torch.device,
    draft_spec: KVCacheSpec | None = None,
) -> int:
    """Blocks for the KV cache: explicit, from a byte budget, from the device's free memory
    (CUDA), or a default budget on CPU capped at what `max_num_seqs` full sequences can use.
    A draft model's cache has as many blocks, so it shares the byte budget."""
    blocks_per_seq = -(-max_model_len // spec.block_size)
    bytes_per_block = spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec else 0)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory is not None:
        num_blocks = config.kv_cache_memory // bytes_per_block
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total
        num_blocks = int(budget) // bytes_per_block
    else:
        num_blocks = min(
            DEFAULT_CPU_KV_CACHE_BYTES // bytes_per_block,
            blocks_per_seq * config.max_num_seqs,
        )
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            f"the KV cache ({num_blocks} blocks of {spec.block_size} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len} tokens; give it more memory "
            "(kv_cache_memory / num_kv_blocks) or lower max_model_len"
        )
    return num_blocks


def num_swap_blocks(config: EngineConfig, spec: KVCacheSpec, num_device_blocks: int) -> int:
    """Host blocks for swap preemption: `swap_space` GiB, never more than the device has."""
    if config.preemption_mode != "swap":
        return 0
    return min(int(config.swap_space * 1024**3) // spec.bytes_per_block, num_device_blocks)
