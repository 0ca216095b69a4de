"""How many KV blocks the engine gets, from its settings and the device's memory."""

from __future__ import annotations

import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError, EngineConfig
from tokenmill.layers.kv_cache import KVCacheSpec


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
