"""The KV connector seam, as vLLM v1 draws it: one class, two halves, two instances.

The scheduler-side instance decides: for a new request, how many tokens' KV it can supply
beyond the local prefix-cache hit, and whether they load within the step or arrive later
(`get_num_new_matched_tokens`), which of the blocks just allocated to fill
(`update_state_after_alloc`), what the worker should load, save and send this step
(`build_connector_meta`), and whether a finished request's blocks may be freed now
(`request_finished`). The worker-side instance acts on that metadata around the forward:
`start_load_kv` before it, `wait_for_save` after it (the forward runs every layer in one call,
so there is no per-layer `save_kv_layer` hook yet), and `get_finished` after each step says
which asynchronous loads and sends have ended; the scheduler half hears it through
`update_connector_output`. Nothing else crosses between the halves: the metadata rides on the
`SchedulerOutput`, the worker's answer on the `ModelRunnerOutput`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.config import KVTransferConfig
from tokenmill.metrics.stats import KVTransferStats
from tokenmill.step.request import Request
from tokenmill.step.runner_output import KVConnectorOutput

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
    # What two engines exchanging KV must share (the same model and layout, wherever its
    # files are): a peer with another is refused (kv_transfer/fingerprint.py).
    transfer_fingerprint: str = ""

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
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens past the `num_computed_tokens` found locally whose KV this connector can
        supply (never the request's last token: it must be computed for logits), and whether
        they arrive asynchronously: then the request is admitted with blocks for them, waits
        off the step until `get_finished` reports them, and only then computes. May be
        called more than once for a request (admission can fail)."""

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

    def check_kv_transfer_params(self, params: dict[str, Any]) -> None:  # noqa: B027
        """Raise ValueError for a request's `kv_transfer_params` this connector cannot use
        (called when the request is added, so bad input fails there)."""

    def request_refused(self, params: dict[str, Any]) -> None:  # noqa: B027
        """A request carrying `kv_transfer_params` was refused before it reached the
        scheduler (bad input): let go of what they point at, e.g. the producer's hold on its
        prompt's KV, which would otherwise stay until its lease runs out."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished (or was aborted): whether its blocks must stay allocated
        until `get_finished` reports it (an asynchronous send, or a load still running), and
        the `kv_transfer_params` its last output carries (where another engine finds its KV).
        Connectors that save within the step keep nothing (the default)."""
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """What the worker half reported after the last step."""

    def has_pending_transfers(self) -> bool:
        """Whether the engine must keep stepping for this connector with no request to run
        (blocks held for a send, a load on its way)."""
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

    def get_finished(self) -> KVConnectorOutput:
        """After each step (also one that ran no forward): the loads and sends that ended."""
        return KVConnectorOutput()

    def wait_for_transfers(self, timeout: float) -> None:  # noqa: B027
        """Block up to `timeout` seconds or until a transfer ends: an engine with nothing to
        run but transfers to wait for sleeps here instead of spinning."""

    def shutdown(self) -> None:  # noqa: B027
        """Stop the connector's threads and sockets (both halves)."""


@dataclass(frozen=True)
class KVConnectorPair:
    """A connector's two instances in one engine: the scheduler's and the runner's."""

    scheduler: KVConnectorBase  # external KV to load, per-step metadata, when blocks may free
    worker: KVConnectorBase  # loads before the forward, saves after it

    def stats(self) -> KVTransferStats:
        """Both halves' counts, summed."""
        return self.scheduler.stats() + self.worker.stats()

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
