"""Mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (v0.3 tokenizers), or
`[TOOL_CALLS]name[ARGS]{...}` per call (v11+); text before the marker is content. Call ids
are 9 letters and digits, as Mistral's templates require."""

from __future__ import annotations

import json

from tokenmill.entrypoints.http.replies.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
    arguments_json,
    call_from_object,
    random_alphanumeric,
    register_tool_parser,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    start_markers = (TOOL_CALLS,)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return ExtractedToolCalls(content=text)
        try:
            calls = _parse_region(text[start:])
        except ValueError:
            return ExtractedToolCalls(content=text)
        content = text[:start]
        return ExtractedToolCalls(calls, content if content.strip() else None)

    def make_call_id(self) -> str:
        return random_alphanumeric(9)


def _parse_region(region: str) -> list[ParsedCall]:
    parts = [p.strip() for p in region.split(TOOL_CALLS)[1:]]
    if not parts or any(not p for p in parts):
        raise ValueError("empty call")
    if ARGS in parts[0]:
        return [_named_call(p) for p in parts]
    if len(parts) != 1:
        raise ValueError("one JSON array expected")
    value = json.loads(parts[0])
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError("no calls")
    return [call_from_object(v) for v in values]


def _named_call(part: str) -> ParsedCall:
    name, _, arguments = part.partition(ARGS)
    parsed = arguments_json(arguments)
    if not name.strip() or parsed is None:
        raise ValueError("not a call")
    return ParsedCall(name.strip(), parsed)
