"""A request refused or abandoned before it is queued hands its `kv_transfer_params` back (a
decode instance then releases the prefill's hold on its prompt's KV): which errors count, and
the client that leaves while its grammar compiles."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenmill.entrypoints.http.openai.inputs import Prompt
from tokenmill.entrypoints.http.openai.protocol import CompletionRequest
from tokenmill.entrypoints.http.openai.serving_completion import CompletionRun
from tokenmill.entrypoints.http.transport.errors import OpenAIError, bad_request, refused_body
from tokenmill.sampling_params import InvalidRequestError

PARAMS = {"do_remote_prefill": True, "remote_request_id": "r"}


class FakeContext:
    """What `CompletionRun.start` asks of a server context; a grammar that never compiles."""

    max_model_len = 64

    def __init__(self) -> None:
        self.sampling_defaults: dict[str, float] = {}
        self.refused_bodies: list[Any] = []

    def refused(self, body: Any) -> None:
        self.refused_bodies.append(body)

    async def prepare_structured_outputs(self, params) -> None:
        await asyncio.Event().wait()

    async def lora_request(self, model: str | None) -> None:
        return None  # the base model


class GoneClient:
    async def receive(self) -> dict[str, str]:
        return {"type": "http.disconnect"}


def test_a_client_gone_while_its_grammar_compiles_is_refused() -> None:
    ctx = FakeContext()
    request = CompletionRequest(model="m", prompt=[5, 6, 7], max_tokens=4,
                                response_format={"type": "json_object"},
                                kv_transfer_params=PARAMS)  # fmt: skip
    run = CompletionRun(ctx, request, "cmpl-1", [Prompt([5, 6, 7], None)])
    assert asyncio.run(run.start(GoneClient(), 0.0)) is None  # never queued
    assert ctx.refused_bodies == [request]


@pytest.mark.parametrize(
    ("error", "refused"),
    [
        (bad_request("no"), True),
        (InvalidRequestError("max_tokens", "too many"), True),
        (OpenAIError(429, "busy"), True),
        (OpenAIError(503, "the KV did not arrive", code="kv_transfer_failed"), False),
        (RuntimeError("a bug"), False),
    ],
)
def test_only_client_errors_count_as_refusals(error: Exception, refused: bool) -> None:
    """A 4xx is raised before the request is queued; a server error may come after it was
    (the engine has dealt with its KV then)."""
    seen: list[Any] = []
    with pytest.raises(type(error)), refused_body(seen.append, {"kv_transfer_params": PARAMS}):
        raise error
    assert seen == ([{"kv_transfer_params": PARAMS}] if refused else [])
