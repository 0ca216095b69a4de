"""`bench serve` against a GGUF server: the served model's root is a .gguf file, whose
tokenizer sizes the dataset (no --tokenizer flag)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from tokenmill.bench import serve
from tokenmill.bench.datasets import DatasetConfig, generate_dataset
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
