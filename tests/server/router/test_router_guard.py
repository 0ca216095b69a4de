"""What the router checks before it holds a body or sends it on, and a client that leaves: the
API key first, its own body cap, a dropped plain request aborted on the replica."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_utils import replica_urls, start_router
from server_utils import API_KEY, IDLE, MODEL, Server, stop_server, wait_for, wait_until_idle

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BODY_CAP = 1024 * 1024  # the router's --max-request-body-bytes here; the replicas' is 2 MiB
ABORTED = 'tokenmill:request_success_total{finished_reason="abort"}'


@pytest.fixture(scope="module")
def replica(http: httpx.Client) -> Iterator[httpx.Client]:
    """The one replica behind the guarded router, read directly."""
    with httpx.Client(base_url=replica_urls(http)[0], headers=HEADERS, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def router(replica: httpx.Client, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("guarded") / "router.log"
    router = start_router(
        [str(replica.base_url).rstrip("/")], log_path,
        "--api-key", API_KEY, "--max-request-body-bytes", str(BODY_CAP),
    )  # fmt: skip
    yield router
    stop_server(router)


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident memory (VmHWM, Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    """A body sent chunked (no Content-Length), `total` bytes."""
    for _ in range(total // size):
        yield b"x" * size


def post(router: Server, content: object, headers: dict[str, str]) -> httpx.Response | None:
    """POST /v1/completions; None when the router closed the connection before the client
    had sent the whole body (it answered without reading the rest)."""
    try:
        return httpx.post(
            f"{router.url}/v1/completions", content=content, headers=headers, timeout=60
        )
    except httpx.TransportError:
        return None


def test_the_key_is_checked_before_the_body(router: Server) -> None:
    """A body over the replicas' own limit, without a key: the router's 401 (it used to read
    it and pass on the replica's 413)."""
    response = post(router, b"x" * (3 * 1024 * 1024), {})
    assert response is not None
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"
    wrong = post(router, b"{}", {"Authorization": "Bearer wrong"})
    assert wrong is not None and wrong.status_code == 401
    assert httpx.get(f"{router.url}/health").status_code == 200  # open, as a server's


def test_a_huge_chunked_body_without_a_key_is_never_held(router: Server) -> None:
    peak = peak_rss_bytes(router.process.pid)
    response = post(router, chunks(256 * 1024 * 1024), {})
    assert response is None or response.status_code == 401
    assert peak_rss_bytes(router.process.pid) - peak < 64 * 1024 * 1024


def test_a_body_past_the_routers_cap_is_a_413(router: Server) -> None:
    peak = peak_rss_bytes(router.process.pid)
    for content in (b"x" * (BODY_CAP + 1), chunks(256 * 1024 * 1024)):
        response = post(router, content, HEADERS)
        if response is not None:  # else cut off while sending: it was not read
            assert response.status_code == 413
            error = response.json()["error"]
            assert error["code"] == "request_too_large" and "router's limit" in error["message"]
    assert peak_rss_bytes(router.process.pid) - peak < 64 * 1024 * 1024
    body = {"model": MODEL, "prompt": "Under the cap", "max_tokens": 2}
    with httpx.Client(base_url=router.url, headers=HEADERS, timeout=60) as routed:
        assert routed.post("/v1/completions", json=body).status_code == 200


def test_a_client_that_leaves_a_plain_request_aborts_it_on_the_replica(
    router: Server, replica: httpx.Client
) -> None:
    before = wait_until_idle(replica)
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 240, "ignore_eos": True, "n": 8}
    payload = json.dumps(body).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + payload)
        running = wait_for(replica, {"tokenmill:num_requests_running": 8})
        assert running["tokenmill:num_requests_running"] == 8
    after = wait_for(replica, {**IDLE, ABORTED: before[ABORTED] + 8})
    assert after[ABORTED] - before[ABORTED] == 8
    assert after["tokenmill:kv_cache_usage_perc"] == 0
