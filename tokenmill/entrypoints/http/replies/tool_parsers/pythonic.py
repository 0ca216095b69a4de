"""Pythonic calls (Llama 3.2 / 4, ToolACE): the whole reply is a Python list of calls,
`[get_weather(city="Paris"), get_time()]`, arguments as keyword literals."""

from __future__ import annotations

import ast
import json

from tokenmill.entrypoints.http.replies.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
    register_tool_parser,
)


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    start_markers = ("[",)
    calls_only_at_start = True

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return ExtractedToolCalls(content=text)
        try:
            calls = _parse_calls(body)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return ExtractedToolCalls(content=text)
        return ExtractedToolCalls(calls)


def _parse_calls(body: str) -> list[ParsedCall]:
    tree = ast.parse(body, mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError("not a list of calls")
    return [_parse_call(element) for element in tree.elts]


def _parse_call(node: ast.expr) -> ParsedCall:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        raise ValueError("a call takes keyword arguments only")
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError("no **kwargs")
        arguments[keyword.arg] = ast.literal_eval(keyword.value)
    return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False))
