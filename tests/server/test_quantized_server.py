"""`tokenmill serve model.gguf`: the file serves completions, and /v1/models reports how its
linear weights are held (`weight_format`, tokenmill's extra field)."""

from __future__ import annotations

from pathlib import Path

import httpx
from gguf import GGMLQuantizationType
from server_utils import API_KEY, MODEL, start_server, stop_server

from tokenmill_testing.gguf_checkpoint import save_gguf


def test_serve_a_gguf_file_reports_its_weight_format(tiny_checkpoint, tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint("llama", hidden_size=256, intermediate_size=512)
    path = save_gguf(checkpoint, tmp_path / "model.gguf", GGMLQuantizationType.Q4_0)
    server = start_server(path, tmp_path / "server.log", "--max-model-len", "128")
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        card = httpx.get(f"{server.url}/v1/models", headers=headers).json()["data"][0]
        assert card["id"] == MODEL
        assert card["weight_format"].startswith("int4-g32 (8 linears)")
        body = {"model": MODEL, "prompt": "The cat", "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    finally:
        stop_server(server)
    assert "weights int4-g32" in (tmp_path / "server.log").read_text()
