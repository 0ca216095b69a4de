"""What the engine reports about itself: plain records, read by the Prometheus metrics, the
stats line and the benchmarks. Counters are totals since start; a reader takes differences."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

# Upper bounds (prompt tokens) of the buckets of the per-step prefill budget histogram.
PREFILL_BUDGET_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and found there, since start."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class KVBlockStates:
    """Where the KV blocks are at a moment: in use, free, free but holding a cached prefix
    (evictable), and copied out to the host swap pool. O(1) to read, from any thread."""

    num_blocks: int
    num_used: int
    num_cached_free: int  # free blocks still findable by their prefix hash
    num_swap_blocks: int  # the host pool's size (0 without --swap-space)
    num_swapped: int  # host blocks holding swapped-out requests
    num_swapped_reqs: int
    block_map: str  # per block (counts above `max_cells`): 0 free, 1 in use, 2 cached free


@dataclass
class SpecDecodeStats:
    """Since start: verification steps with drafts, drafts proposed, drafts accepted, and
    accepted drafts by position (index 0: the first draft of a step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.append(0)
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1


@dataclass
class ItlTargetStats:
    """Since start, under an inter-token-latency target: the prompt tokens each step with
    prompt tokens to compute was given (a histogram over `PREFILL_BUDGET_BUCKETS`, the last
    count for larger ones), and the steps whose time went over the target."""

    itl_target: float  # seconds
    budget_bucket_counts: list[int] = field(
        default_factory=lambda: [0] * (len(PREFILL_BUDGET_BUCKETS) + 1)
    )
    budget_sum: int = 0
    num_steps_over_target: int = 0

    def record_budget(self, num_tokens: int) -> None:
        self.budget_bucket_counts[bisect.bisect_left(PREFILL_BUDGET_BUCKETS, num_tokens)] += 1
        self.budget_sum += num_tokens


class KVTransferRecord(NamedTuple):
    """One request's KV sent or received by a connector's worker half, as it measured it;
    kept in a ring for /metrics and the dashboard (which read the wall clock first)."""

    time: float  # wall clock when it ended
    request_id: str
    direction: str  # "send" | "recv"
    num_bytes: int
    seconds: float
    error: str | None = None  # why it failed; None when the blocks arrived (or left) whole
    reason: str | None = None  # the failure's kind: refused | checksum | timeout | connection


@dataclass
class KVTransferStats:
    """Since start, through the KV connector (tokenmill/kv_transfer/): tokens whose KV was
    loaded instead of computed, the blocks and bytes loaded and saved and the seconds that
    took, and stored blocks found corrupt (recomputed instead)."""

    num_loaded_tokens: int = 0
    num_loaded_blocks: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    num_saved_blocks: int = 0
    bytes_saved: int = 0
    save_seconds: float = 0.0
    num_corrupt_blocks: int = 0
    # Point-to-point (a request's KV pulled by another engine): bytes sent and their
    # seconds, transfers that failed (either way), holds whose lease ran out unread.
    bytes_sent: int = 0
    send_seconds: float = 0.0
    num_failed_transfers: int = 0
    num_expired_requests: int = 0

    def record(self, transfer: KVTransferRecord) -> None:
        """Count one request's transfer (the connector's worker half measured it)."""
        if transfer.error is not None:
            self.num_failed_transfers += 1
        elif transfer.direction == "send":
            self.bytes_sent += transfer.num_bytes
            self.send_seconds += transfer.seconds
        else:
            self.bytes_loaded += transfer.num_bytes
            self.load_seconds += transfer.seconds

    def __add__(self, other: KVTransferStats) -> KVTransferStats:
        return KVTransferStats(
            *(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__)
        )


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int  # in the last step
    num_preemptions: int  # since start, both modes
    num_kv_blocks_used: int
    num_kv_blocks: int
    num_preemptions_by_mode: dict[str, int] = field(default_factory=dict)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec_decode: SpecDecodeStats | None = None
    itl_target: ItlTargetStats | None = None

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks


@dataclass
class EngineStats:
    scheduler: SchedulerStats
    num_steps: int
    # Since start: whole prompts, counted once when their prefill completes (as vLLM counts
    # them), and of those the tokens found in the prefix cache.
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_prompt_tokens: int = 0
    # prompt tokens run through the model (a prompt recomputed after preemption counts again)
    num_computed_prompt_tokens: int = 0
    step_seconds: float = 0.0  # wall time inside steps that ran requests, since start
    forward_seconds: float = 0.0  # of which in the model's forward and logits
    kv_transfer: KVTransferStats | None = None  # with a KV connector
