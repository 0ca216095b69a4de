"""What a hybrid linear-attention model (Qwen3.5, Qwen3-Next: models/hybrid.py) changes in the
engine's assembly: the features it cannot run yet refused, one line each; the state slots'
(and, with prefix caching, their snapshots') bytes taken out of the KV budget; the runner
given the state cache, the KV cache manager its snapshots (docs/hybrid_models.md).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError, EngineConfig
from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.kv.sizing import AVAILABLE_MEMORY_SHARE, KVCacheSize, available_memory_bytes
from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.layers.linear_state import LinearStateCache
from tokenmill.models.families.qwen3_5 import FAMILIES
from tokenmill.models.hybrid import HybridForCausalLM
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

HYBRID_ARCHITECTURES = frozenset(a for family in FAMILIES for a in family.architectures)


def is_hybrid(architecture: str) -> bool:
    return architecture in HYBRID_ARCHITECTURES


def check_hybrid_config(config: EngineConfig, architecture: str) -> None:
    """One line for the first feature a hybrid model does not run yet."""
    refusals = (
        (_drafts_other_than_ngram(config), "speculative decoding other than method=ngram"),
        (config.preemption_mode == "swap", "preemption_mode=swap (use recompute)"),
        (config.kv_transfer_config is not None, "KV connectors (kv_transfer_config)"),
        (config.enable_lora, "LoRA adapters"),
        (config.enforce_eager is False, "captured decode steps (enforce_eager=False)"),
        (config.tensor_parallel_size > 1, "tensor parallelism (tensor_parallel_size > 1)"),
        (config.pipeline_parallel_size > 1, "pipeline parallelism (pipeline_parallel_size > 1)"),
    )
    for refused, feature in refusals:
        if refused:
            raise ConfigError(
                f"{architecture} (hybrid linear attention) does not support {feature} yet; "
                "see docs/hybrid_models.md"
            )


def _drafts_other_than_ngram(config: EngineConfig) -> bool:
    spec = config.speculative_config
    return spec is not None and spec.method != "ngram"


def num_state_slots(config: EngineConfig) -> int:
    """State slots held: one per running sequence, and as many snapshots at block boundaries
    with prefix caching."""
    return config.max_num_seqs * (2 if config.enable_prefix_caching else 1)


def fit_state_slots(
    config: EngineConfig, bytes_per_slot: int, device: torch.device
) -> EngineConfig:
    """Under the CPU default budget (no kv_cache_memory / num_kv_blocks given), max_num_seqs
    lowered so that the state slots take at most half of it: a real Qwen3.5's state is ~20 MiB
    a sequence, so the default 256 sequences would leave no KV blocks. As vLLM's hybrid cache
    does, the memory bounds how many sequences run; an explicit budget is kept as given."""
    if device.type != "cpu" or config.num_kv_blocks is not None or config.kv_cache_memory:
        return config
    budget = DEFAULT_CPU_KV_CACHE_BYTES
    available = available_memory_bytes()
    if available is not None:
        budget = min(budget, int(available * AVAILABLE_MEMORY_SHARE))
    per_sequence = bytes_per_slot * num_state_slots(replace(config, max_num_seqs=1))
    fitting = max(1, budget // 2 // per_sequence)
    if fitting >= config.max_num_seqs:
        return config
    logger.warning(
        "max_num_seqs lowered from %d to %d: each sequence's linear-attention state takes "
        "%.1f MiB of the %.2f GiB CPU default KV budget (--kv-cache-memory sets it)",
        config.max_num_seqs,
        fitting,
        per_sequence / 2**20,
        budget / 2**30,
    )
    return replace(config, max_num_seqs=fitting)


def blocks_after_states(
    config: EngineConfig, size: KVCacheSize, kv_spec: KVCacheSpec, state_bytes: int
) -> KVCacheSize:
    """The KV blocks left once `state_bytes` (every slot's states) leave the budget; an
    explicit num_kv_blocks is kept as given, and so is a CPU default sized by what the
    sequences use (the states beside it: `fit_state_slots` kept them within half the
    memory limits)."""
    if config.num_kv_blocks is not None:
        return size
    if size.by_use:
        return replace(
            size, reason=f"{size.reason}; {state_bytes / 2**20:.1f} MiB of linear-attention "
            "state beside it"
        )  # fmt: skip
    taken = -(-state_bytes // kv_spec.bytes_per_block)
    if size.num_blocks - taken < 1:
        raise ConfigError(
            f"the linear-attention state of max_num_seqs={config.max_num_seqs} sequences "
            f"({state_bytes / 2**20:.1f} MiB) leaves no KV blocks ({size.reason}): lower "
            "max_num_seqs or give the cache more memory"
        )
    return KVCacheSize(
        size.num_blocks - taken,
        f"{size.reason}, less {state_bytes / 2**20:.1f} MiB of linear-attention state",
    )


def attach_state_cache(
    config: EngineConfig,
    runner: ModelRunner,
    model: HybridForCausalLM,
    kv_cache_manager: KVCacheManager,
    device: torch.device,
) -> None:
    """A state slot per running sequence, held by the runner, read by the model's layers;
    with prefix caching, snapshots at block boundaries that hits end at, dropped with their
    blocks."""
    cache = LinearStateCache(model.state_spec, config.max_num_seqs, device)
    model.use_state_cache(cache)
    runner.use_linear_states(cache)
    if kv_cache_manager.enable_caching:
        snapshots = cache.use_snapshots(config.max_num_seqs, config.block_size)
        kv_cache_manager.hit_ends = snapshots.holds
        kv_cache_manager.block_pool.on_reuse = snapshots.drop
