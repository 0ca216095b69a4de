"""The producer's side of the P2P connector: finished prefills' KV blocks, held for the
consumers that will pull them, and the server those consumers connect to.

A held request is registered by the worker half (from the step's metadata) with its blocks,
its prompt digest, how many pulls to expect and a lease. Each consumer connection is served
by a thread of its own: a hello (checked against this engine's KV layout), then pulls, each
answered by a header (the payload's shape and chunking) and then, per chunk of the blocks
(the consumer says how many blocks a chunk has), a message with each block's CRC-32 and one
point-to-point send of the chunk, gathered into the connection's reused staging buffer. A
request is done (its blocks freed by the scheduler) after its last pull, or when its lease
runs out with no pull in flight.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenmill.kv_transfer.blocks import StagingBuffer, block_crcs, gather_blocks, payload_shape
from tokenmill.kv_transfer.p2p.channel import (
    ChannelError,
    PairGroup,
    join_pair,
    new_pair_name,
    open_store,
    recv_message,
    send_message,
)
from tokenmill.metrics.stats import KVTransferRecord

logger = logging.getLogger(__name__)


@dataclass
class HeldKV:
    block_ids: list[int]
    prompt_digest: str
    pulls_left: int
    deadline: float  # time.monotonic() after which the blocks are given back unread
    in_flight: int = 0


@dataclass
class SenderEvents:
    """What happened since the worker half last asked (under the sender's lock)."""

    finished: set[str] = field(default_factory=set)
    transfers: list[KVTransferRecord] = field(default_factory=list)
    num_expired: int = 0


class KVSender:
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        host: str,
        port: int,
        fingerprint: str,
        timeout: float,
        on_event: Callable[[], None],
    ) -> None:
        self.kv_caches = kv_caches
        self.on_event = on_event  # a pull ended: the engine may have blocks to free
        self.host = host
        self.fingerprint = fingerprint
        self.timeout = timeout
        self.held: dict[str, HeldKV] = {}
        self.events = SenderEvents()
        self.lock = threading.Condition()
        self._stopping = False
        self._connections: set[socket.socket] = set()
        self._serving: list[threading.Thread] = []
        self.listener = socket.create_server((host, port), reuse_port=False)
        self.port = self.listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="kv-sender", daemon=True)
        self._thread.start()

    # ---- the worker half (engine thread) -------------------------------------------------

    def register(self, request_id: str, held: HeldKV) -> None:
        with self.lock:
            self.held[request_id] = held
            self.lock.notify_all()

    def take_events(self) -> SenderEvents:
        """Expire leases, then hand over what happened since the last call."""
        now = time.monotonic()
        with self.lock:
            for request_id, held in list(self.held.items()):
                if held.deadline < now and held.in_flight == 0:
                    del self.held[request_id]
                    logger.warning(
                        "KV of request %s was not pulled within its lease: blocks freed", request_id
                    )
                    self.events.finished.add(request_id)
                    self.events.num_expired += 1
            events, self.events = self.events, SenderEvents()
        return events

    def shutdown(self) -> None:
        """Stop accepting, end every consumer connection, wait for their threads."""
        self._stopping = True
        for sock in (self.listener, *list(self._connections)):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
        with contextlib.suppress(OSError):
            self.listener.close()
        for thread in [self._thread, *self._serving]:
            thread.join(timeout=5)

    # ---- consumer connections (their own threads) ----------------------------------------

    def _accept(self) -> None:
        while not self._stopping:
            try:
                connection, peer = self.listener.accept()
            except OSError:
                return  # closed: shutting down
            name = f"kv-sender-{peer[0]}:{peer[1]}"
            thread = threading.Thread(
                target=self._serve, args=(connection,), name=name, daemon=True
            )
            self._serving = [t for t in self._serving if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        self._connections.add(connection)
        pair: PairGroup | None = None
        staging = StagingBuffer(self.kv_caches[0].device)
        try:
            pair = self._handshake(connection)
            while not self._stopping:
                self._serve_pull(connection, pair, recv_message(connection), staging)
        except (ChannelError, RuntimeError, OSError) as e:
            if not self._stopping:
                logger.info("a KV consumer connection ended: %s", e)
        finally:
            self._connections.discard(connection)
            if pair is not None:
                pair.close()
            with contextlib.suppress(OSError):
                connection.close()

    def _handshake(self, connection: socket.socket) -> PairGroup:
        hello = recv_message(connection)
        if hello.get("op") != "hello":
            raise ChannelError(f"expected a hello, got {hello.get('op')!r}")
        if hello.get("fingerprint") != self.fingerprint:
            send_message(connection, {"ok": False, "error": "another model or KV layout"})
            raise ChannelError("a consumer of another model or KV layout was refused")
        store = open_store(self.host, self.timeout)
        name = new_pair_name()
        send_message(connection, {"ok": True, "store_port": store.port, "pair": name})
        device = self.kv_caches[0].device
        return join_pair(store, 0, self.host, device, self.timeout, name)

    def _serve_pull(
        self, connection: socket.socket, pair: PairGroup, message: dict, staging: StagingBuffer
    ) -> None:
        request_id = str(message.get("request_id"))
        start = time.perf_counter()
        try:
            claim = self._claim(request_id, message)
        except ValueError as e:  # refused: the held request (if any) keeps its pulls
            send_message(connection, {"ok": False, "error": str(e)})
            refusal = KVTransferRecord(time.time(), request_id, "send", 0, 0.0, str(e), "refused")
            self._record(refusal)
            return
        if claim is None:  # a release: nothing to send
            send_message(connection, {"ok": True, "num_blocks": 0})
            self._pulled(request_id, None)
            return
        held, block_ids = claim
        num_blocks = len(block_ids)
        chunk = max(1, int(message.get("chunk_blocks") or num_blocks))
        shape = payload_shape(self.kv_caches, num_blocks)
        header = {"ok": True, "num_blocks": num_blocks, "chunk_blocks": chunk}
        error = reason = None
        try:
            send_message(connection, {**header, "shape": list(shape)})
            # In chunks, in order (tag: the chunk's index): the consumer may pace them.
            for index, first in enumerate(range(0, num_blocks, chunk)):
                ids = block_ids[first : first + chunk]
                payload = staging.take(payload_shape(self.kv_caches, len(ids)))
                gather_blocks(self.kv_caches, ids, out=payload)
                send_message(connection, {"crc32": block_crcs(payload.cpu())})
                pair.send(payload, index)
        except (RuntimeError, OSError) as e:
            error = f"the send failed: {str(e).strip().splitlines()[0] if str(e) else e!r}"
            reason = "timeout" if "timed out" in str(e).lower() else "connection"
            raise
        finally:
            with self.lock:
                held.in_flight -= 1  # its blocks are read no more
            seconds = time.perf_counter() - start
            record = KVTransferRecord(
                time.time(), request_id, "send", math.prod(shape), seconds, error, reason
            )
            self._pulled(request_id, record)

    def _claim(self, request_id: str, message: dict) -> tuple[HeldKV, list[int]] | None:
        """The held request and the blocks the pull asks for, once the request is
        registered (the pull may arrive before the step that registers it), marked in flight
        (its lease cannot free them while they are read); None for a release of none."""
        deadline = time.monotonic() + self.timeout
        with self.lock:
            while (held := self.held.get(request_id)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(f"no KV is held for request {request_id!r}")
                self.lock.wait(left)
            if message.get("prompt_digest") != held.prompt_digest:
                raise ValueError(f"request {request_id!r} has another prompt or cache_salt")
            first, count = message.get("first_block"), message.get("num_blocks")
            if not (isinstance(first, int) and isinstance(count, int)) or not (
                first >= 0 and count >= 0 and first + count <= len(held.block_ids)
            ):
                raise ValueError(f"blocks {first}+{count} are outside request {request_id!r}")
            if count == 0:
                return None
            held.in_flight += 1
        return held, held.block_ids[first : first + count]

    def _pulled(self, request_id: str, record: KVTransferRecord | None) -> None:
        """One pull of `request_id` is over (sent, released, or its send failed)."""
        with self.lock:
            held = self.held.get(request_id)
            if held is not None:
                held.pulls_left -= 1
                if held.pulls_left <= 0:
                    del self.held[request_id]
                    self.events.finished.add(request_id)
        if record is not None:
            self._record(record)
        self.on_event()

    def _record(self, record: KVTransferRecord) -> None:
        with self.lock:
            self.events.transfers.append(record)
