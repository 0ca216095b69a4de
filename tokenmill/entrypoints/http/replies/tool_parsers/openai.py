"""gpt-oss (harmony, replies/harmony.py): a call is a `commentary` message addressed
`to=functions.NAME`, its JSON arguments the message's text; the answer is the other
messages' text (reasoning, if no reasoning parser took it, is dropped, as vLLM's parser does).
Its markers are special tokens, so replies are decoded with them (`keeps_special_tokens`)."""

from __future__ import annotations

from tokenmill.entrypoints.http.replies.harmony import SPECIAL_TOKENS, parse_harmony
from tokenmill.entrypoints.http.replies.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
    arguments_json,
    register_tool_parser,
)


@register_tool_parser("openai")
class OpenAIToolParser(ToolParser):
    start_markers = ("<|start|>", "<|channel|>", " to=functions.")
    keeps_special_tokens = True

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if not any(token in text for token in SPECIAL_TOKENS):
            return ExtractedToolCalls(
                content=text
            )  # plain text (the answer a reasoning parser left)
        calls, content = [], []
        for message in parse_harmony(text):
            name = message.function
            arguments = None if name is None else arguments_json(message.text.strip() or "{}")
            if name is not None and arguments is not None:
                calls.append(ParsedCall(name, arguments))
            elif message.channel != "analysis":
                content.append(message.raw if name is not None else message.text)
        return ExtractedToolCalls(calls, "".join(content) or None)
