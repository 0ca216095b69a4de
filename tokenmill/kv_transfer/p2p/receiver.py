"""The consumer's side of the P2P connector: pulls of prompt KV from the producers that hold it.

One link per producer address, made at its first pull: a control connection, the hello, a
two-rank group (`channel.py`), and a thread that runs the link's pulls in order. A pull asks
for a request's blocks from `first_block` on; the producer answers with a header (or a refusal)
and sends them in chunks, each after its blocks' CRC-32s, received into the link's reused
staging buffer and checked before any of it is written into this engine's cache.
A pull of no blocks only releases the producer's hold (a request that found its whole prompt
in the local prefix cache, or that was aborted first). A link that fails (the producer died,
a timeout, garbage) is closed and made again by the next pull; the failed pull is reported,
never retried here: the scheduler decides (`kv_load_failure_policy`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenmill.kv_transfer.blocks import StagingBuffer, block_crcs, payload_shape, scatter_blocks
from tokenmill.kv_transfer.p2p.channel import (
    ChannelError,
    PairGroup,
    join_pair,
    recv_message,
    send_message,
)
from tokenmill.kv_transfer.p2p.params import RemotePrefill
from tokenmill.metrics.stats import KVTransferRecord

logger = logging.getLogger(__name__)


class TransferFailed(Exception):
    """A pull that did not deliver its blocks; `reason` is its metrics label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # refused | checksum | timeout | connection


@dataclass(frozen=True)
class PullJob:
    request_id: str  # this engine's
    remote: RemotePrefill
    first_block: int  # of the remote request's blocks
    block_ids: list[int]  # this engine's blocks to fill, in order (none: only a release)


@dataclass
class ReceiverEvents:
    finished: set[str] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    transfers: list[KVTransferRecord] = field(default_factory=list)


class KVReceiver:
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        fingerprint: str,
        timeout: float,
        on_event: Callable[[], None],
        chunk_bytes: int = 16 << 20,
        duty_cycle: float = 1.0,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.on_event = on_event
        cache = kv_caches[0]  # [2, blocks, block_size, heads, head_dim] per layer
        block_bytes = len(kv_caches) * cache[:, 0].numel() * cache.element_size()
        self.chunk_blocks = max(1, chunk_bytes // block_bytes)
        self.duty_cycle = duty_cycle
        self.cpus = cpus  # where the links' threads run (None: the process's CPUs)
        self.links: dict[tuple[str, int], _Link] = {}
        self.events = ReceiverEvents()
        self.lock = threading.Lock()

    def submit(self, job: PullJob) -> None:
        address = job.remote.address
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = _Link(self, address)
        link.jobs.put(job)

    def pace(self, busy_seconds: float) -> None:
        """After `busy_seconds` of receiving: rest so that receiving takes `duty_cycle` of
        the time (1: no rest)."""
        if self.duty_cycle < 1.0:
            time.sleep(busy_seconds * (1.0 / self.duty_cycle - 1.0))

    def take_events(self) -> ReceiverEvents:
        with self.lock:
            events, self.events = self.events, ReceiverEvents()
        return events

    def shutdown(self) -> None:
        for link in self.links.values():
            link.stop()

    def report(self, job: PullJob, record: KVTransferRecord | None) -> None:
        with self.lock:
            if job.block_ids:  # a release is nobody's load
                if record is None or record.error is None:
                    self.events.finished.add(job.request_id)
                else:
                    self.events.failed[job.request_id] = record.error
            if record is not None:
                self.events.transfers.append(record)
        self.on_event()


class _Link:
    """The connection to one producer and the thread that runs its pulls in order."""

    def __init__(self, receiver: KVReceiver, address: tuple[str, int]) -> None:
        self.receiver = receiver
        self.address = address
        self.jobs: queue.Queue[PullJob | None] = queue.Queue()
        self.sock: socket.socket | None = None
        self.pair: PairGroup | None = None
        self.staging = StagingBuffer(receiver.kv_caches[0].device)
        name = f"kv-receiver-{address[0]}:{address[1]}"
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.tag = 0
        self.thread.start()

    def stop(self) -> None:
        """End the thread after the pull it is running (a pull is bounded by the timeout)."""
        self.jobs.put(None)
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # a pull waiting on a reply fails now
        self.thread.join(timeout=self.receiver.timeout + 5)
        self._close()

    def _run(self) -> None:
        if self.receiver.cpus is not None:
            os.sched_setaffinity(0, self.receiver.cpus)  # this thread only (Linux)
        while (job := self.jobs.get()) is not None:
            start = time.perf_counter()
            try:
                num_bytes = self._pull(job)
                seconds = time.perf_counter() - start
                record = KVTransferRecord(time.time(), job.request_id, "recv", num_bytes, seconds)
            except Exception as e:
                failure = e if isinstance(e, TransferFailed) else _unexpected(e)
                logger.warning("KV of request %s did not arrive: %s", job.request_id, failure)
                if failure.reason != "refused":
                    self._close()
                seconds = time.perf_counter() - start
                record = KVTransferRecord(
                    time.time(), job.request_id, "recv", 0, seconds, str(failure), failure.reason
                )
            self.receiver.report(job, record if job.block_ids or record.error else None)

    def _pull(self, job: PullJob) -> int:
        """Pull `job`'s blocks into the cache; their bytes. Raises TransferFailed."""
        try:
            sock, pair = self._connect()
            num_blocks = len(job.block_ids)
            send_message(
                sock,
                {
                    "op": "pull",
                    "request_id": job.remote.request_id,
                    "prompt_digest": job.remote.prompt_digest,
                    "first_block": job.first_block,
                    "num_blocks": num_blocks,
                    "chunk_blocks": self.receiver.chunk_blocks,
                },
            )
            reply = recv_message(sock)
            if not reply.get("ok"):
                raise TransferFailed("refused", f"the producer refused: {reply.get('error')}")
            if not num_blocks:
                return 0
            return self._receive(sock, pair, reply, job.block_ids)
        except ChannelError as e:
            reason = "timeout" if "in time" in str(e) else "connection"
            raise TransferFailed(reason, f"{self._peer()}: {e}") from e
        except (RuntimeError, OSError) as e:  # gloo: a timeout or a broken pair
            reason = "timeout" if "timed out" in str(e).lower() else "connection"
            raise TransferFailed(reason, f"{self._peer()}: {_first_line(e)}") from e

    def _receive(
        self, sock: socket.socket, pair: PairGroup, reply: dict, block_ids: list[int]
    ) -> int:
        """Receive the blocks chunk by chunk, each checked (CRC-32 per block) before it is
        written into the cache, pausing between chunks to keep the receiver's share of the
        time to `duty_cycle` (the decode steps on the same cores go on); their bytes."""
        num_blocks = len(block_ids)
        caches = self.receiver.kv_caches
        expected = payload_shape(caches, num_blocks)
        chunk = reply.get("chunk_blocks")
        if reply.get("shape") != list(expected):
            raise TransferFailed("refused", f"a header for another layout: {reply.get('shape')}")
        if not isinstance(chunk, int) or chunk < 1:
            raise TransferFailed("refused", f"a header without chunks: {chunk!r}")
        for index, first in enumerate(range(0, num_blocks, chunk)):
            start = time.perf_counter()
            count = min(chunk, num_blocks - first)
            crcs = recv_message(sock).get("crc32")
            if not isinstance(crcs, list) or len(crcs) != count:
                raise TransferFailed("refused", f"chunk {index} came without its CRCs")
            payload = self.staging.take(payload_shape(caches, count))
            pair.recv(payload, index)
            for offset, (crc, actual) in enumerate(zip(crcs, block_crcs(payload.cpu()))):
                if crc != actual:
                    block = first + offset
                    raise TransferFailed("checksum", f"block {block} arrived corrupted (CRC-32)")
            scatter_blocks(caches, block_ids[first : first + count], payload)
            if first + count < num_blocks:
                self.receiver.pace(time.perf_counter() - start)
        return math.prod(expected)

    def _connect(self) -> tuple[socket.socket, PairGroup]:
        if self.sock is not None and self.pair is not None:
            return self.sock, self.pair
        timeout = self.receiver.timeout
        sock = socket.create_connection(self.address, timeout=timeout)
        try:
            sock.settimeout(timeout)
            send_message(sock, {"op": "hello", "fingerprint": self.receiver.fingerprint})
            reply = recv_message(sock)
            if not reply.get("ok"):
                raise TransferFailed("refused", f"{self._peer()} refused: {reply.get('error')}")
            local_ip = sock.getsockname()[0]
            store = (self.address[0], int(reply["store_port"]))
            device = self.receiver.kv_caches[0].device
            pair = join_pair(store, 1, local_ip, device, timeout, str(reply["pair"]))
        except BaseException:
            sock.close()
            raise
        self.sock, self.pair = sock, pair
        return sock, pair

    def _close(self) -> None:
        if self.pair is not None:
            self.pair.close()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock = self.pair = None

    def _peer(self) -> str:
        return f"the KV producer {self.address[0]}:{self.address[1]}"


def _unexpected(error: Exception) -> TransferFailed:
    logger.error("a KV pull failed unexpectedly", exc_info=error)
    return TransferFailed("connection", f"the pull failed: {_first_line(error)}")


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
