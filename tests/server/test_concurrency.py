"""Many clients at once, and clients that leave early: outputs stay right, KV comes back."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from server_utils import IDLE, MODEL, Server, wait_for, wait_until_idle

ABORTED = 'tokenmill:request_success_total{finished_reason="abort"}'

NUM_CLIENTS = 64


def test_64_concurrent_streams_all_complete_correctly(
    client: openai.OpenAI, async_client: openai.AsyncOpenAI, http: httpx.Client
) -> None:
    prompts = [f"Request number {i} says" for i in range(NUM_CLIENTS)]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    expected = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]

    async def stream(prompt: str) -> tuple[str, str | None]:
        chunks = await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        texts, reason = [], None
        async for chunk in chunks:
            texts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(texts), reason

    async def run_all() -> list[tuple[str, str | None]]:
        return await asyncio.gather(*(stream(p) for p in prompts))

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == expected
    assert all(reason in ("stop", "length") for _, reason in results)
    assert wait_until_idle(http)["tokenmill:kv_cache_usage_perc"] == 0


def test_streams_cut_mid_way_are_aborted_and_free_their_kv(
    server: Server, http: httpx.Client
) -> None:
    before = wait_until_idle(http)
    body = {
        "model": MODEL, "prompt": "Tell me everything", "max_tokens": 200, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    for _ in range(4):
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # generation has started; now hang up
    with http.stream("POST", "/v1/chat/completions", json={**body, "prompt": None,
                     "messages": [{"role": "user", "content": "Hi"}]}) as response:  # fmt: skip
        next(response.iter_lines())
    after = wait_for(http, {**IDLE, ABORTED: before[ABORTED] + 5})
    assert after["tokenmill:kv_cache_usage_perc"] == 0
    assert after[ABORTED] - before[ABORTED] == 5
    length = 'tokenmill:request_success_total{finished_reason="length"}'
    assert after[length] == before[length]  # none ran to its 200 tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_hangs_up_mid_request_is_aborted(
    server: Server, http: httpx.Client, stream: bool
) -> None:
    """A raw socket that sends its request and closes once the engine is running it."""
    before = wait_until_idle(http)
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 240, "ignore_eos": True, "n": 8}
    payload = json.dumps({**body, "stream": stream}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Authorization: {http.headers['Authorization']}\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + payload)
        running = wait_for(http, {"tokenmill:num_requests_running": 8})
        assert running["tokenmill:num_requests_running"] == 8
    after = wait_for(http, {**IDLE, ABORTED: before[ABORTED] + 8})
    assert after[ABORTED] - before[ABORTED] == 8
    assert after["tokenmill:kv_cache_usage_perc"] == 0
