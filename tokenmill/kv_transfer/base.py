"""The KV connector seam, as vLLM v1 draws it: one class, two halves, two instances.

The scheduler-side instance decides: for a new request, how many tokens' KV it can supply
beyond the local prefix-cache hit (`get_num_new_matched_tokens`), which of the blocks just
allocated to fill (`update_state_after_alloc`), what the worker should load and save this step
(`build_connector_meta`), and whether a finished request's blocks may be freed now
(`request_finished`). The worker-side instance acts on that metadata around the forward:
`start_load_kv` before it, `wait_for_save` after it (the forward runs
every layer in one call, so there is no per-layer `save_kv_layer` hook yet). Nothing else crosses
between the halves: the metadata rides on the `SchedulerOutput`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.config import KVTransferConfig
from tokenmill.metrics.stats import KVTransferStats
from tokenmill.step.request import Request

if TYPE_CHECKING:
    import torch

    from tokenmill.layers.kv_cache import KVCacheSpec
    from tokenmill.step.scheduler_output import SchedulerOutput


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorMetadata:
    """What the scheduler half tells the worker half about one step (per connector)."""


@dataclass(frozen=True)
class KVConnectorContext:
    """What a connector knows of the engine it serves."""

    kv_cache_spec: KVCacheSpec
    # Identifies the model and KV layout: KV saved under one fingerprint is never loaded
    # under another (kv_transfer/fingerprint.py).
    model_fingerprint: str
    # The prefix cache's chained block hashes of a request (cache_salt in the first block),
    # `KVCacheManager.block_hashes`: the keys of stored blocks.
    block_hashes: Callable[[Request], list[bytes]]

    @property
    def block_size(self) -> int:
        return self.kv_cache_spec.block_size


class KVConnectorBase(ABC):
    """Both halves of a connector; the engine makes one instance per role."""

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
    ) -> None:
        self.config = config
        self.role = role
        self.context = context
        self._metadata: KVConnectorMetadata | None = None
        self.kv_caches: list[torch.Tensor] = []  # the worker half's, once registered

    # ---- scheduler side ----------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past the `num_computed_tokens` found locally whose KV this connector can
        supply: whole blocks, never the request's last token (it must be computed for
        logits). May be called more than once for a request (admission can fail)."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request was admitted with `block_ids` (its whole block table) and
        `num_external_tokens` tokens to be loaded after its local hit."""

    @abstractmethod
    def build_connector_meta(
        self,
        scheduler_output: SchedulerOutput,
        requests: Mapping[str, Request],
        block_ids: Callable[[str], list[int]],
    ) -> KVConnectorMetadata:
        """What the worker loads and saves this step; resets the per-step state."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """The request finished: True if its blocks must stay allocated until the connector
        is done with them (an asynchronous send). Connectors that save within the step
        return False (the default)."""
        return False

    def stats(self) -> KVTransferStats:
        """Counts since start, of this half."""
        return KVTransferStats()

    # ---- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The runner's per-layer caches, `[2, num_blocks, block_size, heads, head_dim]`."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: KVConnectorMetadata | None) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @abstractmethod
    def start_load_kv(self) -> None:
        """Before the forward: fill the blocks the metadata says to load (this step's
        attention reads them)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward: every save of this step is done (or handed off) on return."""
