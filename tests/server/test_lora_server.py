"""LoRA over HTTP, through the official openai client: adapters named by `--lora-modules`
(both forms) picked by the request's `model`, base and adapters together, /v1/models listing
each adapter with its parent, runtime load/unload behind the API key (with
TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING), and OpenAI-style errors."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_clients import async_openai_client, keyed_http, openai_client
from server_utils import MODEL, Server, start_server, stop_server

from tokenmill_testing.lora_adapters import merged_reference, save_random_adapter
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapter_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-adapters")
    return {
        "sql": save_random_adapter(model_dir, root / "sql", rank=8, seed=11),
        "chat": save_random_adapter(
            model_dir, root / "chat", rank=4, use_rslora=True, targets=("q_proj", "v_proj"), seed=12
        ),
        "late": save_random_adapter(model_dir, root / "late", rank=8, seed=13),
    }


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(3)
    return [rng.randrange(3, 1000) for _ in range(11)]


@pytest.fixture(scope="module")
def expected(model_dir: Path, adapter_dirs: dict[str, Path], prompt) -> dict[str, list[int]]:
    """Each served name's greedy tokens from transformers + peft (merged)."""
    result = {MODEL: greedy_reference(merged_reference(model_dir, None), [prompt], MAX_TOKENS)}
    for name, path in adapter_dirs.items():
        result[name] = greedy_reference(merged_reference(model_dir, path), [prompt], MAX_TOKENS)
    return {name: tokens[0][0] for name, tokens in result.items()}


@pytest.fixture(scope="module")
def expected_text(lora_server: Server, expected) -> dict[str, str]:
    """The reference's tokens as text, detokenized by the server."""
    with keyed_http(lora_server) as http:
        return {
            name: http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
            for name, tokens in expected.items()
        }


@pytest.fixture(scope="module")
def lora_server(
    model_dir: Path, adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    chat = {"name": "chat", "path": str(adapter_dirs["chat"]), "base_model_name": MODEL}
    previous = os.environ.get("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        server = start_server(
            model_dir,
            tmp_path_factory.mktemp("lora-server") / "server.log",
            "--dtype", "float32", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
            "--lora-modules", f"sql={adapter_dirs['sql']}", json.dumps(chat),
        )  # fmt: skip
    finally:
        if previous is None:
            os.environ.pop("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING")
        else:
            os.environ["TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"] = previous
    yield server
    stop_server(server)


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert reply.model == model
    return reply.choices[0].text


def test_models_lists_adapters_with_their_parent(lora_server: Server, adapter_dirs) -> None:
    models = {m.id: m for m in openai_client(lora_server).models.list()}
    assert set(models) == {MODEL, "sql", "chat"}
    for name in ("sql", "chat"):
        card = models[name].model_dump()
        assert card["parent"] == MODEL and card["root"] == str(adapter_dirs[name])
    assert models[MODEL].model_dump().get("parent") is None


def test_the_model_field_selects_the_adapter(lora_server: Server, prompt, expected_text) -> None:
    """Base and both adapters at once: one engine step mixes them."""
    client = async_openai_client(lora_server)

    async def run_all() -> list[list[int]]:
        names = [MODEL, "sql", "chat"] * 2
        replies = await asyncio.gather(
            *(
                client.completions.create(
                    model=name,
                    prompt=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for name in names
            )
        )
        return [(r.model, r.choices[0].text) for r in replies]

    results = asyncio.run(run_all())
    assert [model for model, _ in results] == [MODEL, "sql", "chat"] * 2
    for model, text in results:
        assert text == expected_text[model]


def test_an_unknown_model_is_404_model_not_found(lora_server: Server, prompt) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        complete(openai_client(lora_server), "no-such-adapter", prompt)
    assert caught.value.code == "model_not_found"


def test_runtime_load_and_unload(lora_server: Server, adapter_dirs, prompt, expected_text) -> None:
    client = openai_client(lora_server)
    body = {"lora_name": "late", "lora_path": str(adapter_dirs["late"])}
    with keyed_http(lora_server) as http:
        loaded = http.post("/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        assert complete(client, "late", prompt) == expected_text["late"]
        again = http.post("/v1/load_lora_adapter", json=body)
        assert again.status_code == 400
        assert "already been loaded" in again.json()["error"]["message"]
        broken = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "lora_path"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        complete(client, "late", prompt)


def test_runtime_updates_need_the_api_key(lora_server: Server, adapter_dirs) -> None:
    body = {"lora_name": "late2", "lora_path": str(adapter_dirs["late"])}
    reply = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json=body)
    assert reply.status_code == 401


def test_runtime_updates_are_off_without_the_variable(server: Server, adapter_dirs) -> None:
    """The session's plain server (no LoRA, no variable) has no such routes."""
    with keyed_http(server) as http:
        body = {"lora_name": "late", "lora_path": str(adapter_dirs["late"])}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 404
