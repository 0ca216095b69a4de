"""The server test-suite's fixtures, pointed at `tokenmill serve --disaggregate`: a router in
front of a prefill instance and a decode instance (each pinned to its own CPUs) that move
each prompt's KV over the P2P connector. Tests in this directory that import the server
tests run them through it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_clients import client_fixtures
from server_utils import Server, start_server, stop_server


@pytest.fixture(scope="session")
def disaggregated_server(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("disaggregated") / "serve.log"
    server = start_server(
        model_dir, log_path,
        "--disaggregate", "--enable-prompt-tokens-details", "--health-check-interval", "0.5",
        timeout=600,
    )  # fmt: skip
    yield server
    stop_server(server)


@pytest.fixture(scope="session")
def server(disaggregated_server: Server) -> Server:
    return disaggregated_server


client, async_client, http = client_fixtures()
