"""`bench serve` against a GGUF server with no --tokenizer flag: the served model's root (a
.gguf file) sizes the dataset when it is on this machine, else the server's /tokenize."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.bench import serve
from tokenmill.bench.datasets import DatasetConfig, generate_dataset
from tokenmill.bench.server_process import ServerProcess
from tokenmill.entrypoints.cli import main
from tokenmill.models.loader import load_tokenizer
from tokenmill_testing.gguf_checkpoint import save_gguf
from tokenmill_testing.random_checkpoint import save_random_checkpoint


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    checkpoint = save_random_checkpoint(root / "hf", "llama")
    return save_gguf(checkpoint, root / "tiny.gguf")


def test_a_gguf_servers_root_is_its_tokenizer(
    gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def served(client: object, base_url: str) -> list[dict]:
        return [{"id": "tiny", "root": str(gguf_file)}]

    monkeypatch.setattr(serve, "get_served_models", served)
    monkeypatch.setattr(serve, "new_http_client", lambda *a: contextlib.AsyncExitStack())
    model, tokenizer = asyncio.run(serve.resolve_model("http://127.0.0.1:1", None, None))
    assert (model, tokenizer) == ("tiny", str(gguf_file))
    config = DatasetConfig(name="random", num_prompts=2, random_input_len=16, random_output_len=4)
    requests = generate_dataset(config, load_tokenizer(tokenizer))
    assert [r.prompt_len for r in requests] == [16, 16]


@pytest.fixture(scope="module")
def remote_gguf_server(
    gguf_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server of a copy of `gguf_file` that is deleted once served: the client does not
    have the server's file, as against a server on another machine."""
    root = tmp_path_factory.mktemp("served")
    served = root / "served.gguf"
    shutil.copy(gguf_file, served)
    args = ["--model", str(served), "--dtype", "float32", "--max-model-len", "256"]
    with ServerProcess([*args, "--disable-log-stats"], root / "server.log", 180) as server:
        served.unlink()
        yield server


def bench_serve(server: ServerProcess, out: Path, *flags: str) -> dict:
    """Three prompts of exactly 24 tokens; the saved result."""
    code = main(
        ["bench", "serve", "--base-url", server.base_url, "--num-prompts", "3",
         "--random-input-len", "24", "--random-output-len", "4", "--random-range-ratio", "0",
         "--save-result", str(out), "--disable-tqdm", *flags]
    )  # fmt: skip
    assert code == 0
    return json.loads(out.read_text())


def test_bench_serve_needs_no_tokenizer_flag_against_a_served_gguf(
    remote_gguf_server: ServerProcess, tmp_path: Path
) -> None:
    result = bench_serve(remote_gguf_server, tmp_path / "result.json")
    assert result["tokenizer_id"] == f"{remote_gguf_server.base_url}/tokenize"
    assert result["completed"] == 3
    assert result["total_input_tokens"] == 3 * 24  # the server counts what /tokenize sized


def test_a_gguf_file_as_tokenizer_flag_sizes_the_dataset(
    remote_gguf_server: ServerProcess, gguf_file: Path, tmp_path: Path
) -> None:
    result = bench_serve(
        remote_gguf_server, tmp_path / "result.json", "--tokenizer", str(gguf_file)
    )
    assert result["tokenizer_id"] == str(gguf_file)
    assert result["total_input_tokens"] == 3 * 24


class _NoTokenizeServer(http.server.BaseHTTPRequestHandler):
    """Lists one model whose root is no local path, and has no /tokenize (404 for POSTs)."""

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "remote", "root": "/nowhere/model.gguf"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_no_tokenize_and_no_tokenizer_flag_is_a_clear_error(capsys) -> None:
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoTokenizeServer) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        code = main(["bench", "serve", "--base-url", url, "--num-prompts", "1", "--disable-tqdm"])
        httpd.shutdown()
    assert code == 1
    err = capsys.readouterr().err
    assert "/tokenize does not exist" in err and "--tokenizer" in err
