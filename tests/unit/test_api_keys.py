"""`--api-key` (repeatable, $TOKENMILL_API_KEY without it) and `--api-key-file`, for serve and
the router alike; and the router passing a client's own key on, so replicas scope by it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tokenmill.entrypoints.cli import build_parser
from tokenmill.entrypoints.http.transport.api_keys import ApiKeys, api_keys_from_args
from tokenmill.entrypoints.router.app import Proxy
from tokenmill.entrypoints.router.balancing.policies import make_policy
from tokenmill.entrypoints.router.balancing.replicas import ReplicaSet


@pytest.mark.parametrize("command", [["serve"], ["router", "--backend", "http://r:1"]])
def test_keys_come_from_repeated_flags_and_a_file(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    key_file = tmp_path / "keys"
    key_file.write_text("# clients\nk3\n\nk4\n")
    args = build_parser().parse_args(
        [*command, "--api-key", "k1", "--api-key", "k2", "--api-key-file", str(key_file)]
    )
    assert api_keys_from_args(args).keys == ("k1", "k2", "k3", "k4")
    assert api_keys_from_args(build_parser().parse_args(command)).keys == ("from-env",)
    key_file.write_text("\n# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        api_keys_from_args(build_parser().parse_args([*command, "--api-key-file", str(key_file)]))


def test_the_router_takes_every_key_and_passes_the_clients_own_on() -> None:
    seen: list[str] = []

    def replica(request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/health", "/metrics"):
            return httpx.Response(200, text="")
        seen.append(request.headers.get("authorization", ""))
        return httpx.Response(200, json={"ok": True})

    replicas = ReplicaSet(["http://replica:8000"])
    proxy = Proxy(replicas, make_policy("round-robin", 0, 0), 0, ApiKeys(("a", "b")), 1 << 20)

    async def run() -> list[int]:
        transport = httpx.MockTransport(replica)
        async with httpx.AsyncClient(
            transport=transport, headers={"Authorization": "Bearer a"}
        ) as client:
            proxy.client = client
            await replicas.check_all(client)
            from fastapi import FastAPI

            app = FastAPI()
            app.add_api_route("/{path:path}", proxy.forward, methods=["GET"])
            front = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r")
            async with front:
                return [
                    (
                        await front.get("/v1/models", headers={"Authorization": f"Bearer {k}"})
                    ).status_code
                    for k in ("b", "c")
                ]

    assert asyncio.run(run()) == [200, 401]
    assert seen == ["Bearer b"]  # the client's key, not the router's own first one
