"""Tool-call parsers, one module per model family; `--tool-call-parser NAME` picks one.
Adding a parser is one module here that registers its class with `register_tool_parser`."""

from tokenmill.entrypoints.http.replies.tool_parsers import (
    hermes,
    llama3_json,
    mistral,
    openai,
    pythonic,
)
from tokenmill.entrypoints.http.replies.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)

__all__ = [
    "ExtractedToolCalls",
    "ParsedCall",
    "ToolParser",
    "get_tool_parser",
    "hermes",
    "llama3_json",
    "mistral",
    "openai",
    "pythonic",
    "register_tool_parser",
    "tool_parser_names",
]
