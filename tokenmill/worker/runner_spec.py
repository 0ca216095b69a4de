"""What a model runner is built from, besides its model and its device."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.layers.kv_groups import KVGroupLayout
from tokenmill.spec_decode.proposer import Proposer


@dataclass(frozen=True)
class RunnerSpec:
    """Decided once by the engine (engine/assembly.py); under tensor parallelism broadcast to
    every rank, which builds the same runner over its shard."""

    kv_cache_spec: KVCacheSpec  # per rank: a rank caches only its own KV heads
    num_kv_blocks: int
    num_swap_blocks: int = 0  # host-memory blocks for swapped-out KV
    seed: int = 0  # of the sampler's generator (unseeded requests)
    proposer: Proposer | None = None  # speculative decoding; under TP n-gram only (a copy each)
    # Which cache tensor and block table each layer uses; None: one tensor a layer, one table.
    kv_groups: KVGroupLayout | None = None
    lora: tuple[int, int] | None = None  # LoRA's (max_loras, max_lora_rank); None: no LoRA
