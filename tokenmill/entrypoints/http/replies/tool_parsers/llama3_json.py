"""Llama 3.1 / 3.2 JSON calls: the whole reply is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

import json

from tokenmill.entrypoints.http.replies.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
    call_from_object,
    register_tool_parser,
)

PYTHON_TAG = "<|python_tag|>"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    start_markers = ("{", PYTHON_TAG)
    calls_only_at_start = True

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        body = body.removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(content=text)
        try:
            calls = _parse_objects(body)
        except ValueError:
            return ExtractedToolCalls(content=text)
        return ExtractedToolCalls(calls)


def _parse_objects(body: str) -> list[ParsedCall]:
    """`{...}; {...}` (the separator optional): every object must be a call, nothing else."""
    decoder = json.JSONDecoder()
    calls, position = [], 0
    while position < len(body):
        value, position = decoder.raw_decode(body, position)
        calls.append(call_from_object(value, ("parameters", "arguments")))
        rest = body[position:].lstrip()
        rest = rest.removeprefix(";").lstrip()
        position = len(body) - len(rest)
    return calls
