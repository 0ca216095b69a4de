"""How many KV blocks the engine gets, from its settings and the device's memory, and why.

On the CPU with no size given the cache holds what `max_num_seqs` sequences of `max_model_len`
tokens can use, capped at `DEFAULT_CPU_KV_CACHE_BYTES` and at half the memory available at
start (whichever is smallest). vLLM's CPU backend takes `VLLM_CPU_KVCACHE_SPACE` GiB, by default
4 GiB in older releases and half of the machine's memory in newer ones, allocated up front:
it assumes a machine of its own. tokenmill targets small, shared machines, so its default
follows the model and the limits served, and the cache's pages are only made resident as
blocks are first written (`layers/kv_cache.py`): a small model serving a few requests costs
memory for those, not for the whole budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError, EngineConfig
from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.layers.kv_groups import KVGroupLayout, kv_group_layout, single_group

# The share of the memory available at start that the default CPU KV cache may take.
AVAILABLE_MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int
    reason: str  # how the size was chosen, for the startup line
    # The CPU default sized by what max_num_seqs sequences of max_model_len use, not by a
    # memory limit: a hybrid model's state slots are held beside it, not taken out of it.
    by_use: bool = False


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 1024**3:.2f} GiB"


def kv_groups_for(
    config: EngineConfig,
    layer_windows: list[int | None] | None,
    num_layers: int,
    max_model_len: int,
) -> KVGroupLayout:
    """The KV groups the engine keeps (layers/kv_groups.py): one where a KV connector moves
    blocks (it knows one block table a request). A model-wide window (a windowed primary
    table) only where it saves blocks at `max_model_len`, and not beside a draft model (whose
    KV goes by the primary table, all of it)."""
    if config.kv_transfer_config is not None:
        return single_group(num_layers)
    layout = kv_group_layout(layer_windows, num_layers)
    if layout.windows[0] is None:
        return layout
    size, chunk = config.block_size, config.max_num_batched_tokens
    saves = layout.blocks_per_seq(max_model_len, size, chunk) + 1 < -(-max_model_len // size)
    return layout if saves and config.speculative_config is None else single_group(num_layers)


def _cpu_default(
    config: EngineConfig, bytes_per_block: int, blocks_per_seq: int, max_model_len: int
) -> KVCacheSize:
    """The smallest of what the served limits can use, the default cap and a share of the
    memory available; the reason names them all and which one was taken."""
    need = blocks_per_seq * config.max_num_seqs
    limits = {
        f"max_num_seqs x max_model_len = {config.max_num_seqs} x {max_model_len} tokens "
        f"({_gib(need * bytes_per_block)})": need,
        f"the cap of {_gib(DEFAULT_CPU_KV_CACHE_BYTES)}": DEFAULT_CPU_KV_CACHE_BYTES
        // bytes_per_block,
    }
    available = available_memory_bytes()
    if available is not None:
        share = int(available * AVAILABLE_MEMORY_SHARE)
        limits[f"half the {_gib(available)} available"] = share // bytes_per_block
    chosen = min(limits, key=lambda name: limits[name])
    reason = (
        f"CPU default: {chosen}, the smallest of {'; '.join(limits)}; resident only as "
        "blocks are used; --kv-cache-memory sets it"
    )
    return KVCacheSize(limits[chosen], reason, by_use=limits[chosen] == need)


def kv_cache_size(
    config: EngineConfig,
    spec: KVCacheSpec,
    max_model_len: int,
    device: torch.device,
    draft_spec: KVCacheSpec | None = None,
    groups: KVGroupLayout | None = None,
) -> KVCacheSize:
    """Blocks for the KV cache: explicit, from a byte budget, from the device's free memory
    (CUDA), or the CPU default (`_cpu_default`). A draft model's cache has as many blocks,
    so it shares the byte budget. A hybrid model's sequence holds every group's blocks: the
    sliding groups only their window's, plus one step's chunk (`KVGroupLayout`)."""
    blocks_per_seq = -(-max_model_len // spec.block_size)
    min_blocks = blocks_per_seq
    if groups is not None and groups.bounded:
        chunk = config.max_num_batched_tokens
        min_blocks = groups.blocks_per_seq(max_model_len, spec.block_size, chunk) + 1
        # Every sequence's window, and one of them a whole chunk (plus the null block).
        steady = groups.blocks_per_seq(max_model_len, spec.block_size)
        blocks_per_seq = steady + -(-(min_blocks - steady + 1) // config.max_num_seqs)
    bytes_per_block = spec.bytes_per_block + (draft_spec.bytes_per_block if draft_spec else 0)
    if config.num_kv_blocks is not None:
        size = KVCacheSize(config.num_kv_blocks, "num_kv_blocks given")
    elif config.kv_cache_memory is not None:
        size = KVCacheSize(
            config.kv_cache_memory // bytes_per_block,
            f"kv_cache_memory {_gib(config.kv_cache_memory)} given",
        )
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total
        size = KVCacheSize(
            int(budget) // bytes_per_block,
            f"free GPU memory within gpu_memory_utilization {config.gpu_memory_utilization}",
        )
    else:
        size = _cpu_default(config, bytes_per_block, blocks_per_seq, max_model_len)
    if size.num_blocks < min_blocks:
        raise ConfigError(
            f"the KV cache ({size.num_blocks} blocks of {spec.block_size} tokens; "
            f"{size.reason}) cannot hold one sequence of max_model_len={max_model_len} "
            "tokens; give it more memory (kv_cache_memory / num_kv_blocks) or lower "
            "max_model_len"
        )
    return size


def num_kv_blocks(
    config: EngineConfig,
    spec: KVCacheSpec,
    max_model_len: int,
    device: torch.device,
    draft_spec: KVCacheSpec | None = None,
) -> int:
    return kv_cache_size(config, spec, max_model_len, device, draft_spec).num_blocks


def num_swap_blocks(config: EngineConfig, spec: KVCacheSpec, num_device_blocks: int) -> int:
    """Host blocks for swap preemption: `swap_space` GiB, never more than the device has."""
    if config.preemption_mode != "swap":
        return 0
    return min(int(config.swap_space * 1024**3) // spec.bytes_per_block, num_device_blocks)
