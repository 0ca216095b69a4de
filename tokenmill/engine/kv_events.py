"""KV cache events published over ZeroMQ in vLLM's wire format (`--kv-events-config`).

Each engine step's events (`core/kv/events.py`) become one `KVEventBatch`, msgpack-encoded as
vLLM's `msgspec` structs are (array-like, tagged by class name), sent on a PUB socket as the
three frames vLLM sends: topic, an 8-byte big-endian sequence number, the payload. A ROUTER
socket on `replay_endpoint` answers a sequence number with the batches kept since it, then
a -1 sequence number and an empty payload, as vLLM's replay does. The socket work happens on
a thread of its own, so a slow subscriber never holds up the step.

pyzmq and msgspec are the optional extra `tokenmill[fleet]`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from tokenmill.config import ConfigError, KVEventsConfig
from tokenmill.core.kv import events as kv

logger = logging.getLogger(__name__)

_END = (-1).to_bytes(8, "big", signed=True)


def _wire_types() -> tuple[Any, ...]:
    """vLLM's event structs (`vllm/distributed/kv_events.py`), made on first use so that the
    engine imports without msgspec."""
    try:
        import msgspec
    except ImportError as e:
        raise ConfigError(
            "kv_events_config with the zmq publisher needs pyzmq and msgspec: "
            "pip install 'tokenmill[fleet]'"
        ) from e

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return msgspec.msgpack.Encoder(), KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


class ZmqEventPublisher:
    """Publishes each step's KV cache events; `close` ends the thread and the sockets."""

    def __init__(
        self, config: KVEventsConfig, log: kv.KVEventLog, data_parallel_rank: int | None = None
    ) -> None:
        try:
            import zmq
        except ImportError as e:
            raise ConfigError(
                "kv_events_config with the zmq publisher needs pyzmq and msgspec: "
                "pip install 'tokenmill[fleet]'"
            ) from e
        self._encoder, self._batch, *self._kinds = _wire_types()
        self._zmq = zmq
        self._log = log
        self._config = config
        self._rank = data_parallel_rank
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.max_queue_size)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """Where the PUB socket listens (a `tcp://*:0` endpoint resolved to its port)."""
        return self._pub.getsockopt_string(self._zmq.LAST_ENDPOINT)

    def flush(self) -> None:
        """Queue the step's events as one batch (none: nothing is sent); dropped with a
        warning when the queue is full."""
        events = self._log.take()
        if not events:
            return
        batch = self._batch(ts=time.time(), events=[self._wire(e) for e in events])
        if self._rank is not None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            logger.warning("KV events queue full: a batch of %d events dropped", len(events))

    def _wire(self, event: kv.KVCacheEvent) -> Any:
        stored, removed, cleared = self._kinds
        if isinstance(event, kv.BlockStored):
            return stored(
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                event.lora_id,
                event.medium,
            )
        if isinstance(event, kv.BlockRemoved):
            return removed(event.block_hashes, event.medium)
        return cleared()

    def _run(self) -> None:
        topic = self._config.topic.encode()
        while True:
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = None
            if batch is _STOP:
                return
            if batch is not None:
                payload = self._encoder.encode(batch)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((topic, seq, payload))
                self._kept.append((self._seq, payload))
                self._seq += 1
            self._serve_replays()

    def _serve_replays(self) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0, self._zmq.POLLIN):
            client, _, start = self._replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self._kept:
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", _END, b""))

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=1)
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()


_STOP = object()
