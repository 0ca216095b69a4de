"""Hermes / Qwen2.5 / Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call, after optional text. The last block may be left unclosed (the model
stopped on its end token)."""

from __future__ import annotations

import json
import re

from tokenmill.entrypoints.http.replies.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
    call_from_object,
    register_tool_parser,
)

START, END = "<tool_call>", "</tool_call>"
_CLOSED_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANY_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    start_markers = (START,)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find(START)
        if start < 0:
            return ExtractedToolCalls(content=text)
        try:
            calls = [_parse_block(body) for body in _ANY_BLOCK.findall(text, start)]
        except ValueError:
            return ExtractedToolCalls(content=text)
        if _ANY_BLOCK.sub("", text[start:]).strip():  # text between or after calls
            return ExtractedToolCalls(content=text)
        content = text[:start]
        return ExtractedToolCalls(calls, content if content.strip() else None)

    def complete_calls(self, region: str) -> list[ParsedCall]:
        calls = []
        for body in _CLOSED_BLOCK.findall(region):
            try:
                calls.append(_parse_block(body))
            except ValueError:
                break
        return calls


def _parse_block(body: str) -> ParsedCall:
    return call_from_object(json.loads(body))
