"""The Responses request as clients send it. Replies are built as plain JSON (items.py), in
the shapes of the openai SDK's `Response` and stream event types."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, FiniteFloat, model_validator

from tokenmill.entrypoints.http.openai.protocol import RequestBody, RequestModel, bounded_tools
from tokenmill.entrypoints.http.responses.metadata import Metadata


class InputText(RequestModel):
    type: str  # input_text / output_text; other part types are refused by name
    text: str | None = None


class MessageItem(RequestModel):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class OtherItem(RequestModel):
    type: str  # reasoning items are skipped; anything else is a 400 naming it


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | OtherItem


class FunctionTool(RequestModel):
    type: str  # "function"; hosted tools (web_search, file_search...) are refused
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ReasoningConfig(RequestModel):
    """`reasoning`: its `effort` goes to the chat template as `reasoning_effort` (gpt-oss's
    template reads it); a `summary` is not written."""

    effort: Literal["low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    text: TextConfig | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None

    _bounded_tools = model_validator(mode="before")(bounded_tools)
