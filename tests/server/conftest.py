"""Fixtures: one real `tokenmill serve` process on a free loopback port for the session (start-up
costs seconds), and clients to talk to it. Tests leave the server idle when they end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import API_KEY, Server, start_server, stop_server


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


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def async_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def http(server: Server) -> Iterator[httpx.Client]:
    """Raw HTTP with the API key, for what the openai client will not send."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        yield http
