"""The weather tool the tool-calling tests offer a model, defined once, in the shape each API
takes it: a call forced by `tool_choice` must fit `WEATHER_SCHEMA` (a city from a short list,
a number of days in 1..7), which the tests check it against."""

from __future__ import annotations

from typing import Any

WEATHER_TOOL_NAME = "get_weather"
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER_DESCRIPTION = "The forecast"

# /v1/chat/completions `tools` entry, and the `tool_choice` naming it.
CHAT_WEATHER_TOOL = {
    "type": "function",
    "function": {"name": WEATHER_TOOL_NAME, "parameters": WEATHER_SCHEMA},
}
CHAT_WEATHER_CHOICE = {"type": "function", "function": {"name": WEATHER_TOOL_NAME}}
# Anthropic's /v1/messages `tools` entry.
MESSAGES_WEATHER_TOOL = {
    "name": WEATHER_TOOL_NAME,
    "description": WEATHER_DESCRIPTION,
    "input_schema": WEATHER_SCHEMA,
}
# OpenAI's /v1/responses `tools` entry.
RESPONSES_WEATHER_TOOL = {
    "type": "function",
    "name": WEATHER_TOOL_NAME,
    "parameters": WEATHER_SCHEMA,
}
