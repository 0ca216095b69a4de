"""The clients the server tests talk through, made one way: the openai SDK's (with the test
API key, no retries) and raw HTTP with the key; and the `client`, `async_client` and `http`
fixtures over a directory's `server`.

Each conftest makes its own three (`client, async_client, http = client_fixtures()`) rather
than sharing one set: pytest caches a session fixture once, so one `client` shared by the
plain server's tests and those run through the router or the disaggregated pair would stay
bound to whichever `server` it was first made for."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from server_utils import API_KEY, Server


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def async_openai_client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def keyed_http(server: Server, timeout: float = 60) -> httpx.Client:
    """Raw HTTP with the API key, for what the openai client will not send."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.Client(base_url=server.url, headers=headers, timeout=timeout)


def client_fixtures() -> tuple[Callable[..., object], ...]:
    """Session fixtures `client`, `async_client` and `http` over the `server` fixture that the
    calling conftest's directory sees."""

    @pytest.fixture(scope="session")
    def client(server: Server) -> openai.OpenAI:
        return openai_client(server)

    @pytest.fixture(scope="session")
    def async_client(server: Server) -> openai.AsyncOpenAI:
        return async_openai_client(server)

    @pytest.fixture(scope="session")
    def http(server: Server) -> Iterator[httpx.Client]:
        with keyed_http(server) as http:
            yield http

    return client, async_client, http
