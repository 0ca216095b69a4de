"""The two planes between a producer and a consumer of KV: a control connection (small JSON
messages over TCP, each prefixed by its length) and a data plane, a two-rank torch.distributed
process group of their own (gloo on CPU, NCCL on CUDA) that moves the blocks with one
point-to-point send and receive per transfer.

The group is "stateless", as vLLM's `StatelessProcessGroup` is: built on a TCPStore that the
producer opens for this one pair, never the process's default group, so an engine can pair with
any number of peers (and run tensor parallelism beside them). Who meets whom is decided on the
control connection: the consumer says hello with its KV layout's fingerprint, the producer
answers with the port of the store it opened, both join the group (producer rank 0, consumer
rank 1). A pair whose transfer failed is closed and made again at the next transfer: after a
timeout gloo's pair is unusable anyway.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import socket
import struct
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_LENGTH = struct.Struct("!I")


class ChannelError(ConnectionError):
    """The peer went away, broke the protocol, or did not answer in time."""


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    """The next message; ChannelError on a closed connection, a timeout or garbage."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if length > MAX_MESSAGE_BYTES:
        raise ChannelError(f"a control message of {length} bytes: not a KV peer")
    try:
        message = json.loads(_recv_exactly(sock, length))
    except ValueError as e:
        raise ChannelError(f"an unreadable control message: {e}") from e
    if not isinstance(message, dict):
        raise ChannelError("a control message that is not a JSON object")
    return message


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytes:
    chunks, left = [], num_bytes
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except TimeoutError as e:
            raise ChannelError("the peer did not answer in time") from e
        except OSError as e:
            raise ChannelError(f"the connection broke: {e}") from e
        if not chunk:
            raise ChannelError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class PairGroup:
    """A two-rank process group for one producer-consumer pair (producer rank 0)."""

    group: dist.ProcessGroup
    store: dist.TCPStore  # kept alive with the group
    rank: int

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        self.group.send([tensor], self.peer, tag).wait()

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        self.group.recv([tensor], self.peer, tag).wait()

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, AttributeError):  # broken already, or no such call
            self.group.shutdown()


def open_store(host: str, timeout: float) -> dist.TCPStore:
    """The producer's side: a store on a free port of `host` for one pair to meet on."""
    return dist.TCPStore(
        host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )


def join_pair(
    store: dist.TCPStore | tuple[str, int],
    rank: int,
    local_ip: str,
    device: torch.device,
    timeout: float,
    name: str,
) -> PairGroup:
    """Join the pair's group as `rank`, binding its data connections to `local_ip`; the
    consumer passes the producer's (host, store port). Blocks until both ranks joined."""
    if not isinstance(store, dist.TCPStore):
        host, port = store
        store = dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=timeout))
    prefixed = dist.PrefixStore(f"tokenmill-kv/{name}", store)
    limit = datetime.timedelta(seconds=timeout)
    if backend_for(device) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
        options._timeout = limit
        group = dist.ProcessGroupGloo(prefixed, rank, 2, options)
    return PairGroup(group, store, rank)


def new_pair_name() -> str:
    return uuid.uuid4().hex
