"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Works with any server speaking the OpenAI streaming protocol (tokenmill, vLLM, llama.cpp):
server-sent events of `data: {json}` lines ending with `data: [DONE]`. The timing rules are
vLLM's (see `metrics.py`): the first chunk carrying a choice is the first token, every later
one adds an inter-chunk gap, and a final usage-only chunk (stream_options.include_usage) gives
the token counts without counting as a token. One deliberate difference: a chat stream's
role-only opening delta is not a token (see `_is_opening_delta`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.metrics import RequestRecord

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")

# httpx logs every request at INFO: thousands of lines that would bury the report.
logging.getLogger("httpx").setLevel(logging.WARNING)


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, bad answers, bad settings)."""


@dataclass
class EndpointConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout: float = 600.0  # seconds for a whole request, stream included

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        self.base_url = self.base_url.rstrip("/")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def is_chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    def payload(self, request: SampleRequest, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.ignore_eos,  # a vLLM extension; output length = dataset's
        }
        if self.is_chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        body.update(self.extra_body)
        return body


def new_http_client(
    timeout: float, max_connections: int | None, headers: dict[str, str] | None = None
) -> httpx.AsyncClient:
    """A pooled client. `trust_env=False`: a benchmark must not go through a proxy."""
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=None),
        trust_env=False,
    )


async def send_request(
    client: httpx.AsyncClient,
    config: EndpointConfig,
    request: SampleRequest,
    record: RequestRecord,
    clock_zero: float,
    max_tokens: int | None = None,
) -> RequestRecord:
    """Stream one request and fill `record` with what was seen; never raises for a request
    that failed (the failure is recorded), so one bad request does not stop a benchmark."""
    body = config.payload(request, max_tokens or request.expected_output_len)
    sent = time.perf_counter()
    record.start_time = sent - clock_zero
    try:
        await asyncio.wait_for(_stream(client, config, body, record, sent), config.request_timeout)
    except asyncio.TimeoutError:
        record.error = f"no complete answer within {config.request_timeout:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as e:
        record.error = f"{type(e).__name__}: {e}"
    if not record.error and record.ttft == 0.0:
        record.error = "the stream ended without any generated chunk"
    record.success = not record.error
    return record


async def _stream(
    client: httpx.AsyncClient,
    config: EndpointConfig,
    body: dict[str, Any],
    record: RequestRecord,
    sent: float,
) -> None:
    async with client.stream("POST", config.base_url + config.endpoint, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {text[:500]}"
            return
        await _read_stream(response, config, record, sent)


async def _read_stream(
    response: httpx.Response, config: EndpointConfig, record: RequestRecord, sent: float
) -> None:
    last = sent
    text_parts: list[str] = []
    async for line in response.aiter_lines():
        data = _sse_data(line)
        if data is None:
            continue
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk and not chunk.get("choices"):
            record.error = f"server error in stream: {json.dumps(chunk['error'])[:500]}"
            return
        now = time.perf_counter()
        if (choices := chunk.get("choices")) and not _is_opening_delta(choices[0], config):
            if record.ttft == 0.0:
                record.ttft = now - sent
            else:
                record.itl.append(now - last)
            last = now
            text_parts.append(_chunk_text(choices[0], config.is_chat))
        if usage := chunk.get("usage"):
            record.output_tokens = int(usage.get("completion_tokens") or 0)
            record.prompt_len = int(usage.get("prompt_tokens") or record.prompt_len)
    record.latency = last - sent
    record.generated_text = "".join(text_parts)


def _sse_data(line: str) -> str | None:
    """The payload of a `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def _is_opening_delta(choice: dict[str, Any], config: EndpointConfig) -> bool:
    """A chat stream's `{"role": "assistant", "content": ""}` opener is no token: tokenmill
    sends it when the request is accepted, before any token exists (vLLM sends it just before
    the first token, so skipping it changes vLLM's TTFT by nothing and drops one ~0 ms gap
    from its ITL)."""
    if not config.is_chat:
        return False
    delta = choice.get("delta") or {}
    return "role" in delta and not delta.get("content") and choice.get("finish_reason") is None


def _chunk_text(choice: dict[str, Any], is_chat: bool) -> str:
    if is_chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def get_served_models(client: httpx.AsyncClient, base_url: str) -> list[dict[str, Any]]:
    """`GET /v1/models`: the served models' entries (id, and in vLLM/tokenmill a `root`)."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = await client.get(url)
    except httpx.HTTPError as e:
        raise BenchError(f"could not list models at {url}: {e}") from None
    if response.status_code == 401:
        given = "the key given was refused" if "authorization" in client.headers else "none given"
        raise BenchError(
            f"{url} answered 401: the server wants its API key ({given}); pass --api-key KEY "
            "or set $TOKENMILL_API_KEY"
        )
    try:
        response.raise_for_status()
        return list(response.json().get("data") or [])
    except (httpx.HTTPError, ValueError) as e:
        raise BenchError(f"could not list models at {url}: {e}") from None
