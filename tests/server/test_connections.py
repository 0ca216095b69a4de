"""Connections that trickle their headers or body are closed after the read timeouts, and
connections beyond the cap are refused at once (entrypoints/http/transport/connections.py): real
sockets on 127.0.0.1 against uvicorn with the server's protocol, short timeouts. Every
socket wait is bounded (a hang guard far above the timeouts under test)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from server_utils import start_server, stop_server

from tokenmill.entrypoints.http.transport import connections
from tokenmill.entrypoints.http.transport.connections import (
    RateLimitedLog,
    guarded_protocol,
    rate_limit_accept_errors,
)

HANG_GUARD_SECONDS = 30.0
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


async def echo_length_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers its length."""
    assert scope["type"] == "http"
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serving(header_timeout: float, body_timeout: float, max_connections: int) -> Iterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        echo_length_app,
        lifespan="off",
        log_config=None,
        access_log=False,
        timeout_keep_alive=5,
        http=guarded_protocol(header_timeout, body_timeout, max_connections),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(HANG_GUARD_SECONDS)
        listener.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_SECONDS)
    sock.settimeout(HANG_GUARD_SECONDS)
    return sock


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, whole."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, "closed before the response"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_headers_trickling_past_the_timeout_close_the_connection() -> None:
    with serving(header_timeout=0.5, body_timeout=30, max_connections=64) as port:
        with connect(port) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: te")  # and nothing more
            assert read_until_closed(sock) == b""
        with connect(port) as idle:  # one that never sends a byte
            assert read_until_closed(idle) == b""


def test_a_body_trickling_past_the_timeout_closes_the_connection() -> None:
    with (
        serving(header_timeout=30, body_timeout=0.5, max_connections=64) as port,
        connect(port) as sock,
    ):
        sock.sendall(b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 100\r\n\r\n")
        sock.sendall(b"x" * 10)  # 90 bytes short
        assert read_until_closed(sock) == b""


def test_requests_in_time_pass_and_a_kept_alive_connection_serves_the_next() -> None:
    with (
        serving(header_timeout=2, body_timeout=2, max_connections=64) as port,
        connect(port) as sock,
    ):
        for _ in range(3):
            sock.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
            response = read_response(sock)
            assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"\r\n\r\n5")
            time.sleep(0.3)  # idle between requests: the header deadline starts anew


def test_connections_beyond_the_cap_are_refused_at_once() -> None:
    with serving(header_timeout=30, body_timeout=30, max_connections=3) as port:
        held = [connect(port) for _ in range(3)]
        for sock in held:  # each is registered once it has been served
            sock.sendall(REQUEST)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        with connect(port) as refused:
            answer = read_until_closed(refused)
        assert answer.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in answer
        held.pop().close()
        deadline = time.monotonic() + HANG_GUARD_SECONDS
        while True:  # the server notices the close on its own time
            with connect(port) as again:
                again.sendall(REQUEST)
                if (answer := read_response(again)).startswith(b"HTTP/1.1 200"):
                    break
            assert time.monotonic() < deadline, answer
            time.sleep(0.05)
        for sock in held:
            sock.close()


def test_a_repeated_warning_is_logged_once_per_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr(connections.time, "monotonic", lambda: now[0])
    log = RateLimitedLog(interval=10.0)
    with caplog.at_level(logging.WARNING, logger="tokenmill.server"):
        for _ in range(500):
            log.warning("socket.accept() out of system resource")
        now[0] += 10.0
        log.warning("socket.accept() out of system resource")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "socket.accept() out of system resource",
        "socket.accept() out of system resource (499 more since the last such line)",
    ]


def test_accept_errors_reach_the_log_rate_limited_and_others_unchanged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.new_event_loop()
    try:
        rate_limit_accept_errors(loop, interval=60.0)
        error = OSError(24, "Too many open files")
        with caplog.at_level(logging.WARNING):
            for _ in range(1000):
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource", "exception": error}
                )
            loop.call_exception_handler({"message": "something else"})
    finally:
        loop.close()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("out of system resource" in m for m in messages) == 1
    assert "Too many open files" in messages[0]
    assert any("something else" in m for m in messages)


# `tokenmill serve` with 256 file descriptors at most (soft and hard: it cannot raise them).
FEW_DESCRIPTORS = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from tokenmill.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_trickling_clients_cannot_starve_a_server_of_file_descriptors(
    model_dir: Path, tmp_path: Path
) -> None:
    """300 connections trickling their headers, against 256 descriptors: before, /health
    stopped answering and the log filled with "Too many open files"; now the cap (256 - 128)
    refuses the excess at once, the header timeout closes the tricklers, /health answers."""
    server = start_server(
        model_dir, tmp_path / "server.log", "--header-read-timeout", "1",
        "--metrics-without-api-key", launcher=("-c", FEW_DESCRIPTORS),
    )  # fmt: skip
    port = int(server.url.rsplit(":", 1)[1])
    tricklers: list[socket.socket] = []
    try:
        for _ in range(300):
            sock = connect(port)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: te")
            tricklers.append(sock)
        deadline = time.monotonic() + HANG_GUARD_SECONDS
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, server.log[-2000:]
            time.sleep(0.1)
        assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200  # no key
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
        log = server.log
        assert "at most 128 connections" in log
        assert "refused a connection: 128 open (--max-connections)" in log
        assert log.count("Too many open files") <= 3
    finally:
        for sock in tricklers:
            sock.close()
        stop_server(server)
