"""The P2P connector: prompt KV moved from a prefill instance to a decode instance with
torch.distributed point-to-point (gloo on CPU, NCCL on CUDA), for prefill/decode
disaggregation (docs/scale_out.md).

The decode instance pulls, as vLLM's NIXL connector reads: the prefill instance (`kv_producer`)
runs a request carrying `{"do_remote_decode": true}` to its one token, then holds its blocks
and answers with where they are (`params.py`). The decode instance (`kv_consumer`) gets the
same request with those params; its scheduler half admits it with blocks for every prompt
token but the last (less what its own prefix cache holds), the worker half pulls them on a
thread while other requests keep decoding (`receiver.py`), and once they have arrived the
request computes its last prompt token and decodes. The producer frees its blocks after the
last pull or when `kv_lease_duration` runs out (`sender.py`).

`kv_connector_extra_config`: `timeout` (seconds a transfer may take, also the connect and the
wait for a hold to be registered; default 30), `kv_lease_duration` (seconds a producer holds
a finished prefill's blocks for its consumers; default 120), `chunk_bytes` (a transfer moves
in chunks of about this size, each checked and written before the next; default 16 MiB) and
`recv_duty_cycle` (the share of time a consumer's receiver may work: below 1 it rests between
chunks, so the decode steps on the same cores are slowed less; default 1) and `recv_cpus`
(CPUs for a consumer's receiving threads, e.g. the prefill instance's on one machine, which is
idle once it has sent: the receive, its checksums and the copy into the cache then take
nothing from the decode steps; default: the process's own).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config import ConfigError, KVTransferConfig
from tokenmill.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
)
from tokenmill.kv_transfer.p2p.params import (
    RemotePrefill,
    TransferParamsError,
    num_consumers,
    prompt_digest,
    wants_remote_decode,
)
from tokenmill.kv_transfer.p2p.receiver import KVReceiver, PullJob
from tokenmill.kv_transfer.p2p.sender import HeldKV, KVSender
from tokenmill.metrics.stats import KVTransferStats
from tokenmill.step.request import Request, RequestStatus
from tokenmill.step.runner_output import KVConnectorOutput
from tokenmill.step.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
DEFAULT_LEASE = 120.0
DEFAULT_CHUNK_BYTES = 16 << 20


@dataclass
class P2pMetadata(KVConnectorMetadata):
    sends: list[tuple[str, HeldKV]] = field(default_factory=list)  # holds to register
    pulls: list[PullJob] = field(default_factory=list)  # loads and releases to start


class P2pConnector(KVConnectorBase):
    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        extra = config.kv_connector_extra_config
        self.timeout = _seconds(extra, "timeout", DEFAULT_TIMEOUT)
        self.lease = _seconds(extra, "kv_lease_duration", DEFAULT_LEASE)
        self.chunk_bytes = int(_seconds(extra, "chunk_bytes", DEFAULT_CHUNK_BYTES))
        self.duty_cycle = _seconds(extra, "recv_duty_cycle", 1.0)
        if self.duty_cycle > 1:
            raise ConfigError("kv_connector_extra_config.recv_duty_cycle must be in (0, 1]")
        self.recv_cpus = _cpus(extra.get("recv_cpus"))
        self._stats = KVTransferStats()
        # scheduler side
        self._remote: dict[str, RemotePrefill] = {}  # consumer: requests yet to pull or release
        self._not_remote: set[str] = set()  # consumer: no (usable) remote prefill
        # consumer: pulls whose blocks are still being written (tokens, blocks)
        self._loading: dict[str, tuple[int, int]] = {}
        self._pending = P2pMetadata()  # what the next step's metadata carries
        # worker side, made once the caches are known
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._activity = threading.Event()

    def stats(self) -> KVTransferStats:
        return KVTransferStats(**vars(self._stats))

    def check_kv_transfer_params(self, params: dict[str, Any]) -> None:
        RemotePrefill.parse(params)
        num_consumers(params)

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Every prompt token past the local hit but the last, loaded asynchronously."""
        remote = self._remote_of(request)
        if remote is None or request.sampling_params.prompt_logprobs is not None:
            return 0, False  # prompt logprobs need every position's logits: computed here
        num_external = request.num_prompt_tokens - 1 - num_computed_tokens
        return (num_external, True) if num_external > 0 else (0, False)

    def _remote_of(self, request: Request) -> RemotePrefill | None:
        """Where the request's prompt KV waits, if it says and if that KV is of its own
        prompt and salt: params of another prompt or tenant are never used (not even to
        release that hold; its lease frees it)."""
        req_id = request.sample_id
        if not self.config.is_kv_consumer or req_id in self._not_remote:
            return None
        if req_id not in self._remote:
            try:
                remote = RemotePrefill.parse(request.kv_transfer_params)
            except TransferParamsError:
                remote = None  # checked at the edge: only a direct Request gets here
            if remote is not None and (
                remote.num_tokens != request.num_prompt_tokens
                or remote.prompt_digest != prompt_digest(request)
            ):
                logger.warning("request %s: kv_transfer_params of another prompt", req_id)
                remote = None
            if remote is None:
                self._not_remote.add(req_id)
                return None
            self._remote[req_id] = remote
        return self._remote[req_id]

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Admitted: pull the external tokens' blocks, or release the producer's hold."""
        remote = self._remote_of(request)
        if remote is None:
            return
        del self._remote[request.sample_id]
        self._not_remote.add(request.sample_id)  # used once: a preempted request recomputes
        if num_external_tokens == 0:
            self._pending.pulls.append(PullJob(request.sample_id, remote, 0, []))
            return
        block_size = self.context.block_size
        first = request.num_computed_tokens // block_size
        end = math.ceil((request.num_computed_tokens + num_external_tokens) / block_size)
        self._pending.pulls.append(PullJob(request.sample_id, remote, first, block_ids[first:end]))
        self._loading[request.sample_id] = (num_external_tokens, end - first)

    def request_refused(self, params: dict[str, Any]) -> None:
        """Release the producer's hold the params name (the digest is checked there)."""
        if not self.config.is_kv_consumer:
            return
        try:
            remote = RemotePrefill.parse(params)
        except TransferParamsError:
            return  # nothing usable: nothing to release
        if remote is not None:
            job_id = f"refused-{remote.request_id}"  # this engine never had an id for it
            self._pending.pulls.append(PullJob(job_id, remote, 0, []))

    def build_connector_meta(
        self,
        scheduler_output: SchedulerOutput,
        requests: Mapping[str, Request],
        block_ids: Callable[[str], list[int]],
    ) -> P2pMetadata:
        metadata, self._pending = self._pending, P2pMetadata()
        return metadata

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.sample_id
        self._not_remote.discard(req_id)
        remote = self._remote.pop(req_id, None)
        if remote is not None:  # never admitted (aborted while waiting): release the hold
            self._pending.pulls.append(PullJob(req_id, remote, 0, []))
        if req_id in self._loading:
            return True, None  # its blocks are being written: freed once the pull ends
        params = request.kv_transfer_params
        if not (self.config.is_kv_producer and wants_remote_decode(params)):
            return False, None
        # Only a prefill that ran to its length cap hands its KV over (as vLLM's NIXL
        # connector): one that stopped early (EOS) is the whole answer already.
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None
        digest = prompt_digest(request)
        deadline = time.monotonic() + self.lease
        held = HeldKV(block_ids, digest, num_consumers(params), deadline)
        self._pending.sends.append((req_id, held))
        assert self.config.engine_id is not None
        remote = RemotePrefill(
            self.config.engine_id,
            self.config.kv_ip,
            self.config.kv_port,
            req_id,
            request.num_prompt_tokens,
            digest,
        )
        return True, remote.as_params()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving:
            num_tokens, num_blocks = self._loading.pop(req_id, (0, 0))
            self._stats.num_loaded_tokens += num_tokens
            self._stats.num_loaded_blocks += num_blocks
        for req_id in output.failed_recving:
            self._loading.pop(req_id, None)
        for record in output.transfers:
            self._stats.record(record)

    def has_pending_transfers(self) -> bool:
        """Releases and holds not yet handed to the worker half (a request aborted while
        the engine idles must still release its producer's blocks)."""
        return bool(self._pending.pulls or self._pending.sends)

    # ---- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list) -> None:
        """Start the producer's server (recording the port it bound when told to take any
        free one, for the scheduler half's params) and the consumer's receiver."""
        super().register_kv_caches(kv_caches)
        fingerprint = self.context.transfer_fingerprint
        if self.config.is_kv_producer:
            self.sender = KVSender(
                kv_caches,
                self.config.kv_ip,
                self.config.kv_port,
                fingerprint,
                self.timeout,
                self._activity.set,
            )
            self.config.kv_port = self.sender.port
            logger.info("KV producer listening on %s:%d", self.config.kv_ip, self.sender.port)
        if self.config.is_kv_consumer:
            self.receiver = KVReceiver(
                kv_caches,
                fingerprint,
                self.timeout,
                self._activity.set,
                self.chunk_bytes,
                self.duty_cycle,
                self.recv_cpus,
            )

    def start_load_kv(self) -> None:
        metadata = self._metadata
        if not isinstance(metadata, P2pMetadata):
            return
        for req_id, held in metadata.sends:
            assert self.sender is not None
            self.sender.register(req_id, held)
        for job in metadata.pulls:
            assert self.receiver is not None
            self.receiver.submit(job)

    def wait_for_save(self) -> None:
        """Nothing to do in the step: sends happen when consumers pull."""

    def get_finished(self) -> KVConnectorOutput:
        output = KVConnectorOutput()
        if self.sender is not None:
            sent = self.sender.take_events()
            output.finished_sending = sent.finished
            output.transfers += sent.transfers
            self._stats.num_expired_requests += sent.num_expired
        if self.receiver is not None:
            received = self.receiver.take_events()
            output.finished_recving = received.finished
            output.failed_recving = received.failed
            output.transfers += received.transfers
        return output

    def wait_for_transfers(self, timeout: float) -> None:
        self._activity.wait(timeout)
        self._activity.clear()

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.shutdown()
        if self.receiver is not None:
            self.receiver.shutdown()


def _seconds(extra: dict[str, Any], key: str, default: float) -> float:
    """A positive number from the extra config (seconds, bytes or a fraction)."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a number > 0, got {value!r}")
    return float(value)


def _cpus(value: Any) -> frozenset[int] | None:
    """`recv_cpus`: a list of CPU numbers this machine has, or None."""
    if value is None:
        return None
    available = set(range(os.cpu_count() or 1))
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(c, int) and not isinstance(c, bool) for c in value)
        or not set(value) <= available
    ):
        raise ConfigError(
            "kv_connector_extra_config.recv_cpus must be a list of this machine's CPU numbers "
            f"({sorted(available)}), not {value!r}"
        )
    return frozenset(value)
