"""The prefix cache's events: blocks stored, blocks removed, everything cleared.

They mirror vLLM's KV cache events (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), so
routers written for vLLM (llm-d's scheduler, vLLM's router) can track which prefixes each
replica holds. Plain values here; `engine/kv_events.py` encodes and publishes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEDIUM = "CPU"  # where the blocks live (vLLM says "GPU" for its device cache)


def external_block_hash(block_hash: bytes) -> int:
    """A block's hash as routers read it: the low 64 bits, an unsigned integer (vLLM's
    default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True)
class BlockStored:
    """Full blocks made findable in the prefix cache, in prompt order: `parent_block_hash` is
    the hash of the block before the first (None at the prompt's start)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str = MEDIUM


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache (their slots handed to new content)."""

    block_hashes: list[int]
    medium: str = MEDIUM


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: no earlier block is findable any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    """The events of the current step, taken by the publisher once the step is done."""

    events: list[KVCacheEvent] = field(default_factory=list)

    def add(self, event: KVCacheEvent) -> None:
        self.events.append(event)

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
