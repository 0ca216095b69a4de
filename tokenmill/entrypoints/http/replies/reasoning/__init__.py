"""Reasoning parsers, one module each; `--reasoning-parser NAME` picks one."""

from tokenmill.entrypoints.http.replies.reasoning import deepseek_r1, openai_gptoss, qwen3
from tokenmill.entrypoints.http.replies.reasoning.base import (
    ReasoningParser,
    ReasoningSplit,
    ReasoningStreamer,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

__all__ = [
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStreamer",
    "deepseek_r1",
    "get_reasoning_parser",
    "openai_gptoss",
    "qwen3",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
