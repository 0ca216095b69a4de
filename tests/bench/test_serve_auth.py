"""`tokenmill bench serve --api-key` against a keyed server: the model look-up sends the key
too (it answered 401 before), and a missing key is an error that says what to pass."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tokenmill.bench.client import BenchError
from tokenmill.bench.serve import add_request_args, resolve_model

API_KEY = "sk-bench-test"


@pytest.fixture
def keyed_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """/v1/models for requests with the key; 401 for the others."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {API_KEY}":
                self._send(401, {"error": {"message": "Incorrect API key provided."}})
            else:
                self._send(200, {"data": [{"id": "keyed-model", "root": str(tmp_path)}]})

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", tmp_path
    server.shutdown()
    server.server_close()


def test_the_model_look_up_sends_the_api_key(keyed_server: tuple[str, Path]) -> None:
    url, root = keyed_server
    assert asyncio.run(resolve_model(url, None, None, API_KEY)) == ("keyed-model", str(root))


def test_a_missing_or_wrong_key_says_what_to_pass(keyed_server: tuple[str, Path]) -> None:
    url, _ = keyed_server
    with pytest.raises(BenchError, match=r"answered 401: .*none given.*--api-key KEY"):
        asyncio.run(resolve_model(url, None, None))
    with pytest.raises(BenchError, match=r"answered 401: .*the key given was refused"):
        asyncio.run(resolve_model(url, None, None, "wrong"))


def test_the_bench_flag_defaults_to_the_servers_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENMILL_API_KEY", API_KEY)
    parser = argparse.ArgumentParser()
    add_request_args(parser)
    assert parser.parse_args([]).api_key == API_KEY
