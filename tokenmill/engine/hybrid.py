"""What a hybrid linear-attention model (Qwen3.5, Qwen3-Next: models/hybrid.py) changes in the
engine's assembly: the features it cannot run yet refused, one line each; prefix caching off
(a prefix hit would skip the tokens the linear layers' state must see); the state slots'
bytes taken out of the KV budget; the runner given the state cache (docs/hybrid_models.md).
"""

from __future__ import annotations

import logging

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.kv.sizing import KVCacheSize
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
        (config.speculative_config is not None, "speculative decoding"),
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
    if config.enable_prefix_caching:
        logger.info(
            "%s: prefix caching is off (hybrid linear attention: a prefix hit would skip the "
            "tokens the linear layers' state must see; docs/hybrid_models.md)",
            architecture,
        )


def blocks_after_states(
    config: EngineConfig, size: KVCacheSize, kv_spec: KVCacheSpec, state_bytes: int
) -> KVCacheSize:
    """The KV blocks left once `state_bytes` (every slot's states) leave the budget; an
    explicit num_kv_blocks is kept as given."""
    if config.num_kv_blocks is not None:
        return size
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
    runner: ModelRunner, model: HybridForCausalLM, max_num_seqs: int, device: torch.device
) -> None:
    """A state slot per running sequence, held by the runner, read by the model's layers."""
    cache = LinearStateCache(model.state_spec, max_num_seqs, device)
    model.use_state_cache(cache)
    runner.use_linear_states(cache)
