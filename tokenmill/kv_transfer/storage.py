"""The storage connector (vLLM's `SharedStorageConnector`): full KV blocks saved to a directory
under the prefix cache's own block hashes, and loaded back for a request whose prefix is not
in the local cache: a prefix cache that survives restarts and is shared by engines on one
machine.

The key of a block is its chained block hash, which starts from the request's `cache_salt`:
a tenant's blocks are never found by another tenant's requests. Blocks are read and verified
(checksum) by the scheduler half when it matches a request, so a corrupt or truncated file
only shortens the match (those tokens are computed instead) and is removed; the verified
bytes go to the worker half in the step's metadata, which copies them into the cache before
the forward. Saves happen in the same step, after the forward: `request_finished` never
needs to hold blocks back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.config import ConfigError, KVTransferConfig
from tokenmill.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
)
from tokenmill.kv_transfer.block_file import BlockLayout, CorruptBlockError, read_block, write_block
from tokenmill.kv_transfer.blocks import block_shape, gather_blocks, scatter_blocks
from tokenmill.metrics.stats import KVTransferStats
from tokenmill.step.request import Request
from tokenmill.step.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class StorageConnectorMetadata(KVConnectorMetadata):
    # (block id, verified payload) to copy into the cache before the forward
    loads: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # (block id, block hash) to write after the forward
    saves: list[tuple[int, bytes]] = field(default_factory=list)


class SharedStorageConnector(KVConnectorBase):
    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        path = config.kv_connector_extra_config.get("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ConfigError(
                "SharedStorageConnector needs kv_connector_extra_config.shared_storage_path "
                "(a directory)"
            )
        self.directory = Path(path) / context.model_fingerprint[:32]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"shared_storage_path {path!r} is not a usable directory: {e}") from e
        spec = context.kv_cache_spec
        self.layout = BlockLayout(block_shape(spec), str(spec.dtype))
        self._stats = KVTransferStats()
        # Scheduler side: the blocks read for a request's last match (first block index,
        # payloads), the loads of the step being planned, how far each request is saved.
        self._matched: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._loads: list[tuple[int, torch.Tensor]] = []
        self._saved_blocks: dict[str, int] = {}

    def block_path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}.kv"

    def stats(self) -> KVTransferStats:
        return KVTransferStats(**vars(self._stats))

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Reads and verifies the blocks it matches, and keeps them for the admission: a
        request that waits for free blocks is asked again each step, and is not read again
        while its local hit stays the same (the blocks are content-addressed)."""
        block_size = self.context.block_size
        first = num_computed_tokens // block_size
        matched = self._matched.pop(request.sample_id, None)
        if matched is not None and matched[0] == first:
            self._matched[request.sample_id] = matched
            return len(matched[1]) * block_size, False
        # Prompt logprobs need the logits of every prompt position: nothing may be skipped.
        if not self.config.is_kv_consumer or request.sampling_params.prompt_logprobs is not None:
            return 0, False
        hashes = self.context.block_hashes(request)
        last = min(len(hashes), (request.num_tokens - 1) // block_size)
        start = time.perf_counter()
        payloads = []
        for index in range(first, last):
            payload = self._read(hashes[index])
            if payload is None:
                break
            payloads.append(payload)
        self._stats.load_seconds += time.perf_counter() - start
        if payloads:
            self._matched[request.sample_id] = (first, payloads)
        return len(payloads) * block_size, False

    def _read(self, block_hash: bytes) -> torch.Tensor | None:
        path = self.block_path(block_hash)
        try:
            return read_block(path, self.layout)
        except FileNotFoundError:
            return None
        except (CorruptBlockError, OSError) as e:
            logger.warning("stored KV block not used, will be recomputed: %s", e)
            self._stats.num_corrupt_blocks += 1
            path.unlink(missing_ok=True)  # the next save of this block rewrites it
            return None

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        matched = self._matched.pop(request.sample_id, None)
        if num_external_tokens == 0 or matched is None:
            return
        first, payloads = matched
        num_blocks = num_external_tokens // self.context.block_size
        assert num_blocks <= len(payloads), "more tokens admitted than were matched"
        for offset, payload in enumerate(payloads[:num_blocks]):
            self._loads.append((block_ids[first + offset], payload))
        self._stats.num_loaded_tokens += num_external_tokens
        self._stats.num_loaded_blocks += num_blocks
        self._stats.bytes_loaded += num_blocks * self.layout.num_bytes

    def build_connector_meta(
        self,
        scheduler_output: SchedulerOutput,
        requests: Mapping[str, Request],
        block_ids: Callable[[str], list[int]],
    ) -> StorageConnectorMetadata:
        metadata = StorageConnectorMetadata(loads=self._loads)
        self._loads = []
        if self.config.is_kv_producer:
            metadata.saves = self._blocks_to_save(scheduler_output, requests, block_ids)
        return metadata

    def _blocks_to_save(
        self,
        scheduler_output: SchedulerOutput,
        requests: Mapping[str, Request],
        block_ids: Callable[[str], list[int]],
    ) -> list[tuple[int, bytes]]:
        """The full blocks whose KV this step completes (drafts, which may be rejected, not
        counted); blocks a request started with (hits, loads) are stored already."""
        for req_id in scheduler_output.preempted_req_ids:
            self._saved_blocks.pop(req_id, None)
        block_size = self.context.block_size
        for new in scheduler_output.scheduled_new_reqs:
            self._saved_blocks[new.req_id] = new.num_computed_tokens // block_size
        saves: dict[bytes, int] = {}
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            num_drafts = len(scheduler_output.scheduled_spec_tokens.get(req_id, ()))
            known_end = request.num_computed_tokens + num_new - num_drafts
            hashes = self.context.block_hashes(request)
            end = min(known_end // block_size, len(hashes))
            start = self._saved_blocks.get(req_id, 0)
            if end <= start:
                continue
            ids = block_ids(req_id)
            for index in range(start, end):
                saves.setdefault(hashes[index], ids[index])
            self._saved_blocks[req_id] = end
        return [(block_id, block_hash) for block_hash, block_id in saves.items()]

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        self._matched.pop(request.sample_id, None)
        self._saved_blocks.pop(request.sample_id, None)
        return False, None

    # ---- worker side -------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        metadata = self._metadata
        if not isinstance(metadata, StorageConnectorMetadata) or not metadata.loads:
            return
        start = time.perf_counter()
        payload = torch.stack([p for _, p in metadata.loads], dim=2)
        scatter_blocks(self.kv_caches, [block_id for block_id, _ in metadata.loads], payload)
        self._stats.load_seconds += time.perf_counter() - start

    def wait_for_save(self) -> None:
        metadata = self._metadata
        if not isinstance(metadata, StorageConnectorMetadata):
            return
        saves = [(i, h) for i, h in metadata.saves if not self.block_path(h).exists()]
        if not saves:
            return
        start = time.perf_counter()
        blocks = gather_blocks(self.kv_caches, [block_id for block_id, _ in saves]).cpu()
        for index, (_, block_hash) in enumerate(saves):
            try:
                write_block(self.block_path(block_hash), blocks[:, :, index], self.layout)
            except OSError as e:  # a lost save costs a future recompute, not this request
                logger.warning("could not store a KV block: %s", e)
                continue
            self._stats.num_saved_blocks += 1
            self._stats.bytes_saved += self.layout.num_bytes
        self._stats.save_seconds += time.perf_counter() - start
