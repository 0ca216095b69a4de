"""The Anthropic Messages wire format (requests as clients send them, the message and errors
as Anthropic's API reference describes them)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, FiniteFloat, Tag, model_validator

from tokenmill.entrypoints.http.openai.protocol import RequestBody, RequestModel, bounded_tools


class AnthropicResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class OtherBlock(RequestModel):
    """Images, documents, redacted thinking...: refused by name (a 400), not by a parse error."""

    type: str


def _block_kind(block: Any) -> str:
    """Blocks are told apart by `type` (so an integer `text` is a 400 naming `text`, not an
    unsupported block); tags are in angle brackets, left out of the error's field path."""
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return f"<{kind}>" if kind in ("text", "tool_use", "tool_result", "thinking") else "<other>"


InputBlock = Annotated[
    Annotated[TextBlock, Tag("<text>")]
    | Annotated[ToolUseBlock, Tag("<tool_use>")]
    | Annotated[ToolResultBlock, Tag("<tool_result>")]
    | Annotated[ThinkingBlock, Tag("<thinking>")]
    | Annotated[OtherBlock, Tag("<other>")],
    Discriminator(_block_kind),
]


class InputMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class AnthropicTool(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom"; server tools (web search...) are refused


class AnthropicToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(RequestBody):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None

    _bounded_tools = model_validator(mode="before")(bounded_tools)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: FiniteFloat | None = Field(None, ge=0, le=1)
    top_p: FiniteFloat | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None


# ---- responses --------------------------------------------------------------------------------


class TextContent(AnthropicResponseModel):
    type: Literal["text"] = "text"
    text: str
    citations: None = None


class ThinkingContent(AnthropicResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseContent(AnthropicResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]
    caller: dict[str, str] = Field(default_factory=lambda: {"type": "direct"})


ContentBlock = TextContent | ThinkingContent | ToolUseContent
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(AnthropicResponseModel):
    """The published schema lists every field, null where it does not apply."""

    input_tokens: int
    output_tokens: int
    cache_creation: None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    inference_geo: None = None
    output_tokens_details: None = None
    server_tool_use: None = None
    service_tier: None = None


class MessageResponse(AnthropicResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    stop_details: None = None
    container: None = None
    usage: AnthropicUsage


class CountTokensResponse(AnthropicResponseModel):
    input_tokens: int


class AnthropicErrorInfo(AnthropicResponseModel):
    type: str
    message: str


class AnthropicErrorResponse(AnthropicResponseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
    request_id: str = Field(default_factory=lambda: f"req_{uuid.uuid4().hex}")
