"""Bad input of every kind: the right status, OpenAI's error shape, and no harm to others."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import openai
import pytest
from server_utils import API_KEY, MAX_MODEL_LEN, MODEL, Server

GOOD_MESSAGES = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": GOOD_MESSAGES, "max_tokens": 4, **fields}


LONG_PROMPT = "word " * (2 * MAX_MODEL_LEN)

# (id, path, JSON body, expected param or None)
BAD_JSON_BODIES = [
    ("missing-prompt", "/v1/completions", {"model": MODEL}, "prompt"),
    ("prompt-wrong-type", "/v1/completions", completion(prompt={"a": 1}), "prompt"),
    ("empty-prompt", "/v1/completions", completion(prompt="", add_special_tokens=False), "prompt"),
    ("empty-prompt-list", "/v1/completions", completion(prompt=[]), "prompt"),
    ("token-out-of-vocab", "/v1/completions", completion(prompt=[1, 10**9]), "prompt"),
    ("negative-token", "/v1/completions", completion(prompt=[[5, -1]]), "prompt"),
    ("prompt-too-long", "/v1/completions", completion(prompt=LONG_PROMPT), "prompt"),
    (
        "prompt-plus-max-tokens",
        "/v1/completions",
        completion(max_tokens=MAX_MODEL_LEN),
        "max_tokens",
    ),
    (
        "chat-too-long",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": LONG_PROMPT}]),
        "messages",
    ),
    ("negative-max-tokens", "/v1/completions", completion(max_tokens=-1), "max_tokens"),
    ("negative-temperature", "/v1/completions", completion(temperature=-0.5), "temperature"),
    ("top-p-zero", "/v1/completions", completion(top_p=0), "top_p"),
    ("top-p-above-one", "/v1/chat/completions", chat(top_p=1.5), "top_p"),
    ("top-k-negative", "/v1/completions", completion(top_k=-5), "top_k"),
    ("min-p-above-one", "/v1/completions", completion(min_p=2), "min_p"),
    ("presence-penalty", "/v1/completions", completion(presence_penalty=3), "presence_penalty"),
    ("frequency-penalty", "/v1/chat/completions", chat(frequency_penalty=-3), "frequency_penalty"),
    (
        "repetition-penalty",
        "/v1/completions",
        completion(repetition_penalty=0),
        "repetition_penalty",
    ),
    ("n-zero", "/v1/completions", completion(n=0), "n"),
    ("n-huge", "/v1/chat/completions", chat(n=10_000), "n"),
    ("seed-too-big", "/v1/completions", completion(seed=2**80), "seed"),
    ("logprobs-too-many", "/v1/completions", completion(logprobs=1000), "logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", chat(top_logprobs=2), "top_logprobs"),
    (
        "top-logprobs-too-many",
        "/v1/chat/completions",
        chat(logprobs=True, top_logprobs=99),
        "top_logprobs",
    ),
    ("logit-bias-key", "/v1/completions", completion(logit_bias={"abc": 1}), "logit_bias"),
    ("logit-bias-value", "/v1/completions", completion(logit_bias={"5": 500}), "logit_bias"),
    (
        "logit-bias-out-of-vocab",
        "/v1/completions",
        completion(logit_bias={"99999999": 1}),
        "logit_bias",
    ),
    (
        "stop-token-out-of-vocab",
        "/v1/completions",
        completion(stop_token_ids=[10**9]),
        "stop_token_ids",
    ),
    ("empty-stop-string", "/v1/completions", completion(stop=[""]), "stop"),
    ("min-tokens-above-max", "/v1/completions", completion(min_tokens=10), "min_tokens"),
    (
        "stream-options-without-stream",
        "/v1/completions",
        completion(stream_options={"include_usage": True}),
        "stream_options",
    ),
    # Types as strict as OpenAI's: no coercion of strings, numbers or floats.
    ("stream-as-string", "/v1/completions", completion(stream="yes"), "stream"),
    ("echo-as-number", "/v1/completions", completion(echo=0), "echo"),
    ("max-tokens-as-string", "/v1/completions", completion(max_tokens="4"), "max_tokens"),
    ("n-as-float", "/v1/chat/completions", chat(n=2.0), "n"),
    ("temperature-as-string", "/v1/chat/completions", chat(temperature="0.5"), "temperature"),
    ("logprobs-as-number", "/v1/chat/completions", chat(logprobs=1), "logprobs"),
    ("ignore-eos-as-string", "/v1/completions", completion(ignore_eos="true"), "ignore_eos"),
    ("token-as-bool", "/v1/completions", completion(prompt=[1, True]), "prompt"),
    (
        "include-usage-as-string",
        "/v1/chat/completions",
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
    ),
    ("suffix", "/v1/completions", completion(suffix="x"), "suffix"),
    ("best-of", "/v1/completions", completion(best_of=3), "best_of"),
    ("no-messages", "/v1/chat/completions", chat(messages=[]), "messages"),
    (
        "bad-role",
        "/v1/chat/completions",
        chat(messages=[{"role": "wizard", "content": "x"}]),
        "messages.0.role",
    ),
    (
        "image-part",
        "/v1/chat/completions",
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        ),
        "messages.0.content",
    ),
    ("message-not-object", "/v1/chat/completions", chat(messages=["hi"]), "messages.0"),
    (
        "max-completion-tokens",
        "/v1/chat/completions",
        chat(max_completion_tokens=10**6),
        "max_completion_tokens",
    ),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [10**12]}, "tokens"),
    ("detokenize-wrong-type", "/detokenize", {"tokens": "abc"}, "tokens"),
]

# (id, path, raw body): not valid JSON objects at all
MALFORMED_BODIES = [
    ("truncated-json", "/v1/completions", b'{"model": "x", "prompt": '),
    ("not-json", "/v1/chat/completions", b"hello there"),
    ("json-array", "/v1/completions", b"[1, 2, 3]"),
    ("json-string", "/v1/chat/completions", b'"prompt"'),
    ("nan-temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("infinite-penalty", "/v1/completions", b'{"prompt": "x", "presence_penalty": 1e999}'),
    ("empty-body", "/v1/completions", b""),
    ("invalid-utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}'),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [case[1:] for case in BAD_JSON_BODIES],
    ids=[case[0] for case in BAD_JSON_BODIES],
)
def test_invalid_parameters_are_400_naming_the_param(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    assert_openai_error(http.post(path, json=body), 400, param)


@pytest.mark.parametrize(
    ("path", "raw"), [case[1:] for case in MALFORMED_BODIES], ids=[c[0] for c in MALFORMED_BODIES]
)
def test_malformed_bodies_are_400(http: httpx.Client, path: str, raw: bytes) -> None:
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_openai_error(response, 400)


def test_context_length_error_uses_vllms_words(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=completion(max_tokens=MAX_MODEL_LEN))
    error = response.json()["error"]
    assert error["message"].startswith(
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens."
    )
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("path", "body", "param", "input_name"),
    [
        (
            "/v1/completions",
            completion(prompt=[5] * MAX_MODEL_LEN, max_tokens=None),
            "prompt",
            "prompt",
        ),
        ("/v1/completions", completion(max_tokens=MAX_MODEL_LEN), "max_tokens", "prompt"),
        ("/v1/chat/completions", chat(max_tokens=MAX_MODEL_LEN), "max_tokens", "messages"),
    ],
    ids=["completions-no-room", "completions-max-tokens", "chat-max-tokens"],
)
def test_context_length_error_names_the_endpoints_input(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, input_name: str
) -> None:
    """Completions have a `prompt`, chat has `messages`: the error names the one sent."""
    response = http.post(path, json=body)
    assert_openai_error(response, 400, param)
    message = response.json()["error"]["message"]
    assert f"the length of the {input_name} or completion" in message
    other = "messages" if input_name == "prompt" else "prompt"
    assert other not in message


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", completion(model="gpt-4")),
        ("POST", "/v1/chat/completions", chat(model="gpt-4")),
        ("GET", "/v1/models/gpt-4", None),
        ("POST", "/tokenize", {"model": "gpt-4", "prompt": "x"}),
        ("POST", "/detokenize", {"model": "gpt-4", "tokens": [1]}),
    ],
    ids=["completions", "chat", "retrieve", "tokenize", "detokenize"],
)
def test_an_unknown_model_is_404_model_not_found(
    http: httpx.Client, method: str, path: str, body: dict[str, Any] | None
) -> None:
    """As OpenAI and vLLM answer: the openai client raises NotFoundError."""
    response = http.request(method, path, json=body)
    assert_openai_error(response, 404, "model")
    error = response.json()["error"]
    assert "gpt-4" in error["message"] and error["code"] == "model_not_found"


def test_the_openai_client_raises_not_found_for_an_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4", messages=GOOD_MESSAGES, max_tokens=1)
    assert raised.value.code == "model_not_found"


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": ""}],
    ids=["none", "wrong-key", "not-bearer", "empty"],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")],
)
def test_v1_routes_need_the_api_key(
    server: Server, headers: dict[str, str], method: str, path: str
) -> None:
    response = httpx.request(method, server.url + path, json=completion(), headers=headers)
    assert_openai_error(response, 401)
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_operational_routes_stay_open(server: Server) -> None:
    for path in ("/health", "/version"):
        assert httpx.get(server.url + path).status_code == 200, path


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/v1/models"])
def test_probe_routes_answer_head_like_get(http: httpx.Client, path: str) -> None:
    """Benchmark tools (aiperf) probe with HEAD before they send GETs."""
    head, get = http.head(path), http.get(path)
    assert head.status_code == get.status_code == 200
    assert head.content == b""
    assert head.headers.get("content-type") == get.headers.get("content-type")


def test_head_on_v1_needs_the_api_key(server: Server) -> None:
    assert httpx.head(server.url + "/v1/models").status_code == 401


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/v2/x")],
)
def test_unknown_routes_and_models_are_404(http: httpx.Client, method: str, path: str) -> None:
    assert_openai_error(http.request(method, path), 404)


def test_bad_inputs_do_not_disturb_a_concurrent_request(http: httpx.Client) -> None:
    good = completion(prompt="Steady", max_tokens=120, temperature=0, ignore_eos=True)
    expected = http.post("/v1/completions", json=good).json()["choices"][0]["text"]
    streamed: list[str] = []

    def stream() -> None:
        with http.stream("POST", "/v1/completions", json={**good, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])

    worker = threading.Thread(target=stream)
    worker.start()
    statuses = set()
    while worker.is_alive() or not statuses:
        for _, path, body, _ in BAD_JSON_BODIES:
            statuses.add(http.post(path, json=body).status_code)
        for _, path, raw in MALFORMED_BODIES:
            statuses.add(http.post(path, content=raw).status_code)
    worker.join()
    assert statuses == {400}
    assert "".join(streamed) == expected
