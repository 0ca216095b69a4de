"""What uvicorn does not bound about a connection: how long its request headers and body may
take to arrive, and how many connections are open at once. Without these a client that
trickles a byte every few seconds holds a socket (a file descriptor) forever, and a few
hundred such clients exhaust the process's descriptors (then `/health` stops answering and
every accept fails). Also: accept errors logged at most once per interval, not once per
attempt.

Applies to uvicorn's h11 protocol, which `tokenmill serve` always selects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("tokenmill.server")

# File descriptors kept for everything but client connections (model files, threads' pipes,
# logs, the tokenizer); the connection cap defaults to the descriptor limit minus these.
RESERVED_FILE_DESCRIPTORS = 128
# The descriptor limit the server raises its soft limit to, if the hard limit allows (as vLLM).
TARGET_FILE_DESCRIPTORS = 65536


def raise_file_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = TARGET_FILE_DESCRIPTORS if hard == resource.RLIM_INFINITY else hard
    target = min(target, TARGET_FILE_DESCRIPTORS)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections() -> int:
    return max(16, raise_file_descriptor_limit() - RESERVED_FILE_DESCRIPTORS)


def _refusal() -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": "The server has too many open connections (--max-connections); "
                "retry later.",
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class RateLimitedLog:
    """One warning per `interval` seconds for a repeated condition, with the number of times
    it happened since the last one."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last = float("-inf")
        self._suppressed = 0

    def warning(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return
        suffix = f" ({self._suppressed} more since the last such line)" if self._suppressed else ""
        logger.warning("%s%s", message, suffix)
        self._last, self._suppressed = now, 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline (from the connection's start, or from
    the first byte of the next request on a kept-alive one), a body deadline (from the end of
    the headers), and a cap on open connections; a connection past a deadline is closed.
    Configure with `guarded_protocol`."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1024
    refusals = RateLimitedLog()
    expiries = RateLimitedLog()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.refusals.warning(
                f"refused a connection: {self.max_connections} open (--max-connections)"
            )
            transport.write(_refusal())
            transport.close()
            return
        self._enter("headers", self.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._phase is None and self.conn.their_state is h11.IDLE:
            self._enter("headers", self.header_timeout)  # the next request on a kept-alive one
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._enter("body", self.body_timeout)
        elif state is not h11.IDLE:  # read in full (DONE), or closing
            self._leave()

    def connection_lost(self, exc: Exception | None) -> None:
        self._leave()
        super().connection_lost(exc)

    def _enter(self, phase: str, timeout: float) -> None:
        self._leave()
        self._phase = phase
        self._deadline = self.loop.call_later(timeout, self._expire)

    def _leave(self) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()  # type: ignore[union-attr]
        self._deadline, self._phase = None, None

    def _expire(self) -> None:
        phase = self._phase
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        idle = phase == "headers" and not self.conn.trailing_data[0]
        if not idle:  # a connection that never sent anything is not worth a line
            timeout = self.header_timeout if phase == "headers" else self.body_timeout
            self.expiries.warning(
                f"closed a connection whose request {phase} took longer than {timeout:g} s "
                f"(--{'header' if phase == 'headers' else 'body'}-read-timeout)"
            )
        self.transport.close()


def guarded_protocol(
    header_timeout: float, body_timeout: float, max_connections: int
) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` class with these limits, for `uvicorn.Config(http=...)`."""
    limits: dict[str, Any] = {
        "header_timeout": header_timeout,
        "body_timeout": body_timeout,
        "max_connections": max_connections,
        "refusals": RateLimitedLog(),
        "expiries": RateLimitedLog(),
    }
    return type("ConfiguredH11Protocol", (GuardedH11Protocol,), limits)


def rate_limit_accept_errors(loop: asyncio.AbstractEventLoop, interval: float = 10.0) -> None:
    """asyncio reports each failed accept (EMFILE: out of file descriptors) through the loop's
    exception handler; let one line per `interval` through, not thousands."""
    accept_errors = RateLimitedLog(interval)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if message.startswith("socket.accept() out of system resource"):
            accept_errors.warning(f"{message}: {context.get('exception')!r}")
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
