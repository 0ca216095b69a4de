"""How the disaggregating router splits a request: which requests it splits, what the prefill
leg asks for, what the decode leg adds, and how a failed KV transfer is recognised."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.router.disaggregation import leg_bodies as bodies

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(
    ("path", "body", "split"),
    [
        (COMPLETIONS, {"prompt": "hi"}, True),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, True),
        (COMPLETIONS, {"prompt": ["hi"]}, True),
        (COMPLETIONS, {"prompt": ["hi", "there"]}, False),  # a batch: served whole
        (COMPLETIONS, {"prompt": [[1, 2], [3]]}, False),
        (COMPLETIONS, {"prompt": "hi", "echo": True, "logprobs": 1}, False),  # prompt logprobs
        (COMPLETIONS, {"prompt": "hi", "echo": True}, True),
        (COMPLETIONS, {"prompt": "hi", "kv_transfer_params": {}}, False),  # the client's own
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, True),
        ("/v1/embeddings", {"input": "hi"}, False),
    ],
)
def test_which_requests_are_split(path: str, body: dict, split: bool) -> None:
    assert bodies.disaggregable(path, body) is split


def test_the_prefill_leg_runs_the_prompt_to_one_token_and_holds_its_kv() -> None:
    body = {
        "prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
        "n": 3, "stop": ["x"], "min_tokens": 5, "logprobs": 2, "temperature": 0.7,
        "cache_salt": "tenant", "response_format": {"type": "json_object"},
    }  # fmt: skip
    leg = json.loads(bodies.prefill_body(COMPLETIONS, body))
    assert leg["max_tokens"] == 1 and leg["stream"] is False and leg["n"] == 1
    assert leg["ignore_eos"] is True  # it ends by length: only then is its KV handed over
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "num_consumers": 3}
    assert leg["cache_salt"] == "tenant" and leg["temperature"] == 0.7  # kept: prompt, tenant
    for dropped in ("stop", "min_tokens", "logprobs", "stream_options", "response_format"):
        assert dropped not in leg
    chat = json.loads(bodies.prefill_body(CHAT, {"messages": [], "max_completion_tokens": 9}))
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1
    assert chat["kv_transfer_params"] == {"do_remote_decode": True}


def test_the_decode_leg_is_the_clients_request_plus_where_the_kv_waits() -> None:
    body = {"prompt": "hi", "max_tokens": 50, "stream": True}
    params = {"do_remote_prefill": True, "remote_request_id": "r"}
    assert json.loads(bodies.decode_body(body, params)) == {**body, "kv_transfer_params": params}
    assert json.loads(bodies.decode_body(body, None)) == body


def test_a_failed_transfer_is_recognised_in_a_body_or_a_streams_first_event() -> None:
    error = {"error": {"message": "m", "type": "server_error", "param": None, "code": None}}
    failed = json.loads(json.dumps(error))
    failed["error"]["code"] = "kv_transfer_failed"
    assert bodies.kv_transfer_failed(503, json.dumps(failed).encode())
    assert not bodies.kv_transfer_failed(503, json.dumps(error).encode())
    assert not bodies.kv_transfer_failed(200, b'{"choices": []}')
    event = f"data: {json.dumps(failed)}\n\ndata: [DONE]\n\n".encode()
    assert bodies.kv_transfer_failed(200, event)
    token = b'data: {"choices": [{"text": "a"}]}\n\n'
    assert not bodies.kv_transfer_failed(200, token)
