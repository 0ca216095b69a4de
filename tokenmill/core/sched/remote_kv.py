"""The requests a KV connector moves KV for asynchronously, as the scheduler keeps them.

Two kinds, vLLM v1's:

- **Waiting for remote KV**: admitted with blocks for the tokens the connector will load
  (`get_num_new_matched_tokens` said "asynchronously"), out of the waiting queue and not
  running: they compute nothing until the worker half reports their KV has arrived. Then
  they go back to the waiting queue holding their blocks, next in line (`RequestQueue`),
  `num_computed_tokens` past the loaded tokens, and the next admission only adds blocks for
  what is left (the last prompt token, at least). A load that failed either ends the
  request with an error (`kv_load_failure_policy` "fail": a router can retry it on a fresh
  prefill) or sends it back to compute those tokens itself ("recompute").
- **Held**: finished (or aborted) requests whose blocks the connector still reads (a send to
  another engine) or writes (an aborted request's load still arriving): freed only when the
  worker half reports that transfer ended, so no other request is given blocks a transfer
  still touches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.core.kv.block_pool import KVCacheBlock
from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.sched.request_queue import RequestQueue
from tokenmill.kv_transfer.base import KVConnectorBase
from tokenmill.outputs import RequestError
from tokenmill.step.request import Request, RequestStatus
from tokenmill.step.request_step_output import RequestStepOutput
from tokenmill.step.runner_output import KVConnectorOutput

KV_TRANSFER_FAILED = "kv_transfer_failed"  # the OpenAI error code of a request whose load failed


@dataclass
class _Loading:
    request: Request
    num_computed_after: int  # its computed tokens once the KV has arrived


class RemoteKVRequests:
    def __init__(
        self, connector: KVConnectorBase, manager: KVCacheManager, waiting: RequestQueue
    ) -> None:
        self.connector = connector
        self.manager = manager
        self.waiting = waiting
        self.loading: dict[str, _Loading] = {}
        self.held: dict[str, Request] = {}
        self.recompute_failed_loads = connector.config.kv_load_failure_policy == "recompute"

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.loading or sample_id in self.held

    @property
    def has_pending(self) -> bool:
        return bool(self.loading or self.held) or self.connector.has_pending_transfers()

    def admit(
        self, request: Request, hits: Sequence[KVCacheBlock], num_hit: int, num_external: int
    ) -> bool:
        """Give a waiting `request` blocks for its `num_hit` cached (`hits`) and
        `num_external` loaded tokens; it leaves the waiting queue until they arrive. False
        when the blocks are not there (it stays waiting)."""
        if self.manager.allocate_slots(request, num_external, hits) is None:
            return False
        self.manager.record_prefix_lookup(request, num_hit)
        request.num_computed_tokens = num_hit
        self.connector.update_state_after_alloc(
            request, self.manager.get_block_ids(request.sample_id), num_external
        )
        self.waiting.remove(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.sample_id] = _Loading(request, num_hit + num_external)
        return True

    def release(self, request: Request) -> dict[str, Any] | None:
        """A request finished (or was aborted, maybe while loading): free its blocks, or hold
        them while the connector still moves them (a send, a load still arriving). Returns
        the connector's `kv_transfer_params` for its last output."""
        self.loading.pop(request.sample_id, None)  # no longer waited for
        block_ids = self.manager.get_block_ids(request.sample_id)
        held, params = self.connector.request_finished(request, block_ids)
        if held:
            self.held[request.sample_id] = request
        else:
            self.manager.free(request)
        return params

    def update(self, output: KVConnectorOutput) -> list[RequestStepOutput]:
        """The worker half's news: loads that arrived go back to the waiting queue, failed
        ones are ended or recomputed, transfers of held requests free their blocks. Returns
        the outputs of requests ended here."""
        self.connector.update_connector_output(output)
        for req_id in output.finished_recving:
            loading = self.loading.pop(req_id, None)
            if loading is not None:
                loading.request.num_computed_tokens = loading.num_computed_after
                self._requeue(loading.request)
        ended = []
        for req_id, reason in output.failed_recving.items():
            loading = self.loading.pop(req_id, None)
            if loading is None:
                continue
            if self.recompute_failed_loads:
                self._requeue(loading.request)  # its blocks stay; it computes them itself
            else:
                ended.append(self._fail(loading.request, reason))
        for req_id in (
            output.finished_sending | output.finished_recving | set(output.failed_recving)
        ):
            request = self.held.pop(req_id, None)
            if request is not None:
                self.manager.free(request)
        return ended

    def _requeue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.add_holding_blocks(request)  # next in line: it holds its blocks

    def _fail(self, request: Request, reason: str) -> RequestStepOutput:
        request.status = RequestStatus.FINISHED_ERROR
        message = f"the KV cache of this request's prompt could not be loaded: {reason}"
        return RequestStepOutput(
            request.sample_id,
            [],
            finish_reason="error",
            error=RequestError(KV_TRANSFER_FAILED, message),
        )
