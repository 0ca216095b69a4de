"""The server test-suite's fixtures, pointed at `tokenmill serve --data-parallel-size 2`: a
router (prefix-aware) in front of two real tiny-model replicas. Tests in this directory that
import the server tests run them through the router."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from router_utils import NUM_REPLICAS, PREFIX_CHARS, child_pids, wait_gone
from server_clients import client_fixtures
from server_utils import Server, start_server, stop_server


@pytest.fixture(scope="session")
def routed_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    server = start_server(
        model_dir, log_path,
        "--data-parallel-size", str(NUM_REPLICAS), "--routing-policy", "prefix-aware",
        "--enable-prompt-tokens-details", "--health-check-interval", "0.5",
        "--prefix-chars", str(PREFIX_CHARS),
        timeout=600,
    )  # fmt: skip
    replicas = child_pids(server.process.pid)
    assert len(replicas) == NUM_REPLICAS
    yield server
    stop_server(server)
    assert not wait_gone(replicas), "replicas outlived `serve --data-parallel-size`"


@pytest.fixture(scope="session")
def server(routed_server: Server) -> Server:
    return routed_server


client, async_client, http = client_fixtures()
