"""One client must never hurt another: poison pills, floods, huge bodies, open mutating routes,
side channels. Against the session's real server."""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import API_KEY, MODEL, Server, scrape, wait_until_idle

SURROGATE = "\ud800"
MESSAGES = [{"role": "user", "content": "Hi"}]


def post_json(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    """json.dumps escapes a lone surrogate as \\ud800, as a hostile client would send it."""
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def probe(http: httpx.Client) -> None:
    """A 4-token completion answers."""
    response = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "probe", "max_tokens": 4}, timeout=120
    )
    assert response.status_code == 200


ABORTED = 'tokenmill:request_success_total{finished_reason="abort"}'


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": f"a{SURROGATE}b"}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["ok", SURROGATE]}, "prompt.1"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "cache_salt": SURROGATE}, "cache_salt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [SURROGATE]}, "stop.0"),
        ("/v1/completions", {"model": SURROGATE, "prompt": "x"}, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "extra": SURROGATE}, "extra"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": SURROGATE}]},
            "messages.0.content",
        ),
        ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    response = post_json(http, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "surrogate" in error["message"]


def test_an_empty_cache_salt_is_rejected_as_vllm_does(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "cache_salt": ""})
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"


def test_a_poison_pill_fails_alone(http: httpx.Client) -> None:
    """A lone surrogate in cache_salt used to fail the engine step and every stream in it."""
    body = {"model": MODEL, "prompt": "Innocent", "max_tokens": 24, "ignore_eos": True}
    endings: list[str] = []

    def stream() -> None:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        endings.append("error" if any('"error"' in e for e in events) else events[-1])

    workers = [threading.Thread(target=stream) for _ in range(12)]
    for worker in workers:
        worker.start()
    poison = post_json(http, "/v1/completions", {**body, "cache_salt": SURROGATE})
    for worker in workers:
        worker.join(60)
    assert endings == ["[DONE]"] * 12  # before the fix: 12 x "error" (engine_step_failed)
    assert poison.status_code == 400
    wait_until_idle(http)


def test_too_many_prompts_x_n_is_400_before_any_work(http: httpx.Client) -> None:
    before = scrape(http)
    flood = http.post("/v1/completions", json={"model": MODEL, "prompt": [[5]] * 60_000})
    assert flood.status_code == 400 and flood.json()["error"]["param"] == "prompt"
    assert "1024" in flood.json()["error"]["message"]
    many_samples = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": [[5]] * 9, "n": 128}
    )
    assert many_samples.status_code == 400
    after = scrape(http)
    for name in ("tokenmill:prompt_tokens_total", "tokenmill:num_requests_waiting"):
        assert after[name] == before[name], name  # nothing reached the engine


def test_a_client_leaving_with_a_flood_of_prompts_does_not_stall_others(server: Server) -> None:
    """60,000 prompts whose client left used to stall a 4-token probe for minutes (its abort
    was one pass over the queue per request; tests/model/test_engine.py checks the one pass);
    now such a body is refused, and one at the cap is aborted when its client leaves."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
        before = scrape(http)
        for num_prompts in (60_000, 1024):
            flood = {"model": MODEL, "prompt": [[5, 6]] * num_prompts, "max_tokens": 50}
            with contextlib.suppress(httpx.ReadTimeout):  # the client leaves
                http.post("/v1/completions", json={**flood, "ignore_eos": True}, timeout=1.0)
            probe(http)
        idle = wait_until_idle(http)
        assert idle["tokenmill:num_requests_waiting"] == idle["tokenmill:num_requests_running"] == 0
        generated = (
            idle["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"]
        )
        assert generated < 1024 * 50  # the flood at the cap was aborted, not run to its end
        assert idle.get(ABORTED, 0) > before.get(ABORTED, 0)


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
)
def test_a_body_over_the_limit_is_413_on_every_route(http: httpx.Client, path: str) -> None:
    huge = json.dumps({"model": MODEL, "prompt": "x" * (3 * 1024 * 1024)}).encode()
    declared = http.post(path, content=huge, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413
    assert declared.json()["error"]["message"].startswith("The request body is larger")

    def chunked():  # no Content-Length: counted while read
        for start in range(0, len(huge), 64 * 1024):
            yield huge[start : start + 64 * 1024]

    streamed = http.post(path, content=chunked(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413


def test_huge_prompts_do_not_block_the_event_loop(http: httpx.Client) -> None:
    """Tokenizing one 10 MB prompt froze /health for seconds; now bodies are capped, and text
    too long to fit the context is refused without being tokenized (the message counts its
    bytes, not its tokens), so /health keeps answering."""
    big = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB
    results: list[httpx.Response] = []

    def attack(path: str, body: dict[str, Any]) -> None:
        results.append(http.post(path, json=body, timeout=120))

    attacks = [threading.Thread(target=attack, args=("/tokenize", {"prompt": big})) for _ in "abc"]
    attacks.append(
        threading.Thread(target=attack, args=("/v1/completions", {"model": MODEL, "prompt": big}))
    )
    for thread in attacks:
        thread.start()
    for _ in range(5):
        assert http.get("/health").status_code == 200
    probe(http)
    for thread in attacks:
        thread.join(120)
    assert [r.status_code for r in results] == [400] * 4
    for response in results:
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and "bytes long" in error["message"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/reset_prefix_cache", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [5]}),
    ],
)
def test_mutating_and_costly_routes_need_the_api_key(
    server: Server, method: str, path: str, body: Any
) -> None:
    response = httpx.request(method, server.url + path, json=body)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.request(method, server.url + path, json=body, headers=keyed).status_code == 200


def test_metrics_need_the_api_key(server: Server) -> None:
    """/metrics' prefix-cache counters moved by exactly the cached tokens of another client's
    unsalted prompt: a side channel open to anyone without the key."""
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert "prefix_cache" not in response.text


def test_every_response_says_nosniff(server: Server) -> None:
    for path in ("/health", "/version", "/v1/models", "/nope"):
        response = httpx.get(server.url + path)
        assert response.headers["x-content-type-options"] == "nosniff", path


# ---- no input produces a 5xx --------------------------------------------------------------------

# Any code point, lone surrogates and NUL among them; those two drawn often, since among all
# of Unicode's code points a random draw would rarely pick one.
HOSTILE_CHARS = st.sampled_from(["\ud800", "\udfff", "\x00"])
ANY_TEXT = st.text(
    st.one_of(HOSTILE_CHARS, st.characters(codec=None, exclude_categories=())), max_size=12
)
HUGE_INTS = st.one_of(st.integers(-3, 3), st.integers(-(2**80), 2**80))
ANY_NUMBER = st.one_of(HUGE_INTS, st.floats(allow_nan=True, allow_infinity=True))
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), ANY_NUMBER, ANY_TEXT, st.lists(HUGE_INTS, max_size=3)
)
SMALL_MAX_TOKENS = st.one_of(st.integers(0, 3), HUGE_INTS, st.none())

PROMPTS = st.one_of(ANY_TEXT, st.lists(ANY_TEXT, max_size=3), st.lists(HUGE_INTS, max_size=4))
FIELDS = st.dictionaries(
    st.sampled_from(
        [
            "n",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop",
            "cache_salt",
            "priority",
            "logit_bias",
            "logprobs",
            "stop_token_ids",
            "min_tokens",
            "user",
            "echo",
            "stream",
            "model",
            "presence_penalty",
            "repetition_penalty",
            "min_p",
            "top_logprobs",
        ]
    ),
    ANY_VALUE,
    max_size=3,
)


@st.composite
def any_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["completions", "chat", "tokenize", "detokenize"]))
    fields = draw(FIELDS)
    if kind == "completions":
        body = {"model": MODEL, "prompt": draw(PROMPTS), "max_tokens": draw(SMALL_MAX_TOKENS)}
        return "/v1/completions", {**body, **fields}
    if kind == "chat":
        content = draw(
            st.one_of(
                ANY_TEXT,
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": ANY_TEXT}), max_size=2
                ),
            )
        )
        role = draw(st.sampled_from(["user", "system", "assistant", "robot"]))
        body = {"model": MODEL, "messages": [{"role": role, "content": content}]}
        return "/v1/chat/completions", {**body, "max_tokens": draw(SMALL_MAX_TOKENS), **fields}
    if kind == "tokenize":
        return "/tokenize", {"prompt": draw(ANY_TEXT), **fields}
    return "/detokenize", {"tokens": draw(st.lists(HUGE_INTS, max_size=4)), **fields}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=any_request())
def test_no_input_produces_a_5xx(http: httpx.Client, request: tuple[str, dict[str, Any]]) -> None:
    path, body = request
    raw = json.dumps(body)  # lone surrogates escaped, NaN and Infinity as Python writes them
    headers = {"Content-Type": "application/json"}
    with http.stream("POST", path, content=raw, headers=headers) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.status_code < 500, (response.status_code, raw)
    assert not any('"server_error"' in event for event in events), raw
