"""Fixtures: one real `tokenmill serve` process on a free loopback port for the session (start-up
costs seconds), and clients to talk to it (server_clients.py). Tests leave the server idle
when they end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from server_clients import client_fixtures
from server_utils import Server, start_server, stop_server


@pytest.fixture(scope="session")
def model_dir(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    server = start_server(
        model_dir, log_path, "--log-stats-interval", "1", "--enable-prompt-tokens-details"
    )
    yield server
    stop_server(server)


client, async_client, http = client_fixtures()
