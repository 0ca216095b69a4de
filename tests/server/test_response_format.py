"""Structured outputs over HTTP: the openai SDK's `response_format`, vLLM's
`structured_outputs` and `guided_*` fields, streaming, n > 1, and 400s naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_utils import MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 4},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["city", "rank", "tags"],
    "additionalProperties": False,
}
# A random model pads with whitespace as readily as anything else (docs/server.md).
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
DIGIT = {"type": "integer", "minimum": 10, "maximum": 99}
COLOR = {"enum": ["red", "blue"]}
MESSAGES = [{"role": "user", "content": "Where is the meeting?"}]


def _json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


def nested_schema(depth: int) -> str:
    """An object schema `depth` objects deep, as JSON text (too deep for `json.dumps`)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


def test_openai_sdk_response_format_json_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=80,
        n=3,
        temperature=1.0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "meeting", "schema": SCHEMA, "strict": True},
        },
        extra_body=COMPACT,
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_openai_sdk_json_object_streams(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=60,
        temperature=0.0,
        stream=True,
        response_format={"type": "json_object"},
        extra_body=COMPACT,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert text.startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"


@pytest.mark.parametrize(
    "fields, check",
    [
        ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
        ({"guided_regex": r"\d{2}-[ab]"}, lambda t: re.fullmatch(r"\d{2}-[ab]", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"grammar": 'root ::= "go" [0-9]'}}, lambda t: t[:2] == "go"),
        ({"guided_grammar": 'root ::= "id" [0-9] [0-9]'}, lambda t: re.fullmatch(r"id\d\d", t)),
        ({"guided_json": DIGIT}, lambda t: 10 <= json.loads(t) <= 99),
        ({"structured_outputs": {"json": DIGIT}}, lambda t: 10 <= json.loads(t) <= 99),
        # OpenAI's field on completions too (as vLLM accepts it).
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": COLOR}}},
            lambda t: json.loads(t) in ("red", "blue"),
        ),
        # Any JSON object: it starts one (a random model rarely closes it within 12 tokens).
        ({"response_format": {"type": "json_object"}, **COMPACT}, lambda t: t.startswith("{")),
        ({"structured_outputs": {"json_object": True}}, lambda t: t.lstrip().startswith("{")),
    ],
)
def test_vllm_fields_constrain_completions(client: openai.OpenAI, fields, check) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="Pick one:", max_tokens=12, n=2, temperature=1.0, extra_body=fields
    )
    assert all(check(choice.text) for choice in reply.choices), reply.choices


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": {"type": "object", "required": "city"}}, "guided_json"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        # vLLM clients' keys: an unknown one, one xgrammar cannot honour, another backend's
        ({"structured_outputs": {"json": {}, "fields": 1}}, "structured_outputs.fields"),
        (
            {"structured_outputs": {"json": {}, "whitespace_pattern": " ?"}},
            "structured_outputs.whitespace_pattern",
        ),
        (
            {"structured_outputs": {"regex": "a", "backend": "outlines"}},
            "structured_outputs.backend",
        ),
        (
            {"structured_outputs": {"regex": "a", "disable_fallback": "y"}},
            "structured_outputs.disable_fallback",
        ),
        # past the size bound (structured_outputs_config max_schema_bytes)
        ({"guided_json": {"enum": [f"value-{i:06d}" for i in range(5000)]}}, "guided_json"),
    ],
)
def test_invalid_constraints_are_400_naming_the_field(
    http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(
    "body, message",
    [
        (  # refused by the JSON Schema meta-schema (jsonschema's words after the prefix)
            {"response_format": _json_schema_format({"properties": {"a": {"minimum": "x"}}})},
            "response_format is not a valid JSON schema: 'x' is not of type 'number'",
        ),
        (  # refused by xgrammar
            {"guided_json": {"$ref": "#/nowhere"}},
            "guided_json is not a valid JSON schema: Cannot find field 'nowhere' in #/nowhere",
        ),
    ],
    ids=["meta-schema", "xgrammar"],
)
def test_an_invalid_schema_is_named_once_in_the_message(
    http: httpx.Client, body: dict[str, Any], message: str
) -> None:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == message


@pytest.mark.parametrize("depth", [40, 160, 300, 400, 499])
def test_deeply_nested_schemas_are_400_naming_the_field(http: httpx.Client, depth: int) -> None:
    """160-499 levels were a RecursionError in the schema check: a 500. (Around 500 levels,
    1,000 nested containers, the body's JSON parser itself refuses it, also a 400.)"""
    body = f'{{"messages": {json.dumps(MESSAGES)}, "guided_json": {nested_schema(depth)}}}'
    response = http.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if depth < 450:
        assert error["param"] == "guided_json" and "levels deep" in error["message"], error


def test_vllm_options_that_change_nothing_with_xgrammar_are_accepted(http: httpx.Client) -> None:
    options = {
        "backend": "xgrammar",
        "disable_fallback": True,
        "disable_additional_properties": True,
    }
    body = {"structured_outputs": {"regex": "[ab]{3}", **options}, "max_tokens": 8}
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    assert re.fullmatch("[ab]{3}", response.json()["choices"][0]["message"]["content"])


def test_json_schema_at_temperature_1_validates_with_the_default_whitespace(
    client: openai.OpenAI,
) -> None:
    """No disable_any_whitespace: whitespace between JSON tokens is bounded by default, so a
    random model at temperature 1 cannot pad an object with spaces to max_tokens (before:
    most replies ended with finish_reason "length", mid-object)."""
    for seed in range(4):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=120,
            n=4,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "meeting", "schema": SCHEMA, "strict": True},
            },
        )
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
