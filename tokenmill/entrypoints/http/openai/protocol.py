"""The OpenAI wire format as pydantic models: requests as clients send them, responses as
OpenAI's published schema describes them (so `/openapi.json` is generated from the truth).

Requests accept unknown fields (real clients send plenty; they are logged and ignored). Types are
checked here, strictly as OpenAI checks them (`"stream": "yes"`, `"echo": 0`, `"n": 2.0` are
400s, not coerced); value ranges are checked once, by `SamplingParams`, so HTTP and offline
agree.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, model_validator

from tokenmill.entrypoints.http.transport.body_checks import (
    check_num_sequences,
    check_num_tools,
    check_unicode,
)

# OpenAI's own limits where it documents one; vLLM's default max_logprobs otherwise.
MAX_N = 128
MAX_LOGPROBS = 20


class RequestModel(BaseModel):
    """Unknown fields are kept in `model_extra` (for the log line) and otherwise ignored; known
    ones take exactly their JSON type (an integer is a number, nothing else converts)."""

    model_config = ConfigDict(extra="allow", strict=True)


class RequestBody(RequestModel):
    """A whole request body: checked as a whole once (transport/body_checks.py), before its
    fields. Only bodies check, not the models inside them: a check per nested model walked the
    same text again at every level (70,000 messages took half a second)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_as_a_whole(cls, data: Any) -> Any:
        check_unicode(data)
        return data


def bounded_tools(cls: type, data: Any) -> Any:
    """A model validator (mode "before") for bodies with `tools`: their number is checked
    before any of them is (`MAX_TOOLS`)."""
    if isinstance(data, dict):
        check_num_tools(data.get("tools"))
    return data


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far.
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs`: one of json / regex / choice / grammar / json_object, and
    vLLM's options. Unlike the rest of a body, an unknown key here is a 400 naming it: it was
    meant to shape the output, and silently ignoring it would not."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Accepted as vLLM accepts them; they change nothing with xgrammar (sampling_params.py).
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    # Refused unless null: xgrammar has neither.
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # vLLM's backend names that mean xgrammar ("auto", "xgrammar"); others are a 400.
    backend: str | None = None


class SamplingRequest(RequestBody):
    """The fields completions and chat share: model, sampling, stopping, streaming."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: int | None = None
    min_p: FiniteFloat | None = None
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    repetition_penalty: FiniteFloat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, FiniteFloat] | None = None
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions: scheduling priority (lower first, with --scheduling-policy priority)
    # and a salt that keeps this tenant's prompts out of others' prefix-cache hits.
    priority: int = 0
    cache_salt: str | None = None
    # vLLM's: for a KV connector (prefill/decode disaggregation, docs/scale_out.md).
    kv_transfer_params: dict[str, Any] | None = None
    # Structured outputs (docs/server.md): OpenAI's field, vLLM's, and vLLM's older ones.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _bounded_sequences(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_num_sequences(data.get("prompt"), data.get("n", 1))
        return data


class TextContentPart(RequestModel):
    """A part of a message's content; only `text` parts are supported (others get a 400)."""

    type: str
    text: str | None = None


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends and returns it


class ToolCall(RequestModel):
    """A call the assistant made, in the history (request) or the reply (response)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (vLLM's field)


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none means "no arguments"
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call exactly this one."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    # Unset: "auto" when there are tools, else "none" (tool_calling.py), as OpenAI and vLLM.
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # Passed to the chat template (gpt-oss's reads it into its system message).
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    _bounded_tools = model_validator(mode="before")(bounded_tools)


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a `prompt`, or `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt; the template's for chat
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Only with --enable-prompt-tokens-details; otherwise absent (OpenAI's schema has no null).
    prompt_tokens_details: PromptTokensDetails | None = Field(None, exclude_if=lambda v: v is None)


# "error": the request could not go on (structured outputs: no token can continue the
# grammar); stop_reason says why. vLLM reports it the same way.
FinishReason = Literal["stop", "length", "error"]
# A chat choice also ends "tool_calls" when its reply was parsed into calls.
ChatFinishReason = Literal["stop", "length", "error", "tool_calls"]


class CompletionLogprobs(ResponseModel):
    text_offset: list[int]
    # None at the first prompt token under `echo`: nothing came before it to predict it.
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that matched


class CompletionResponse(ResponseModel):
    """A completion, and (with `stream`) each chunk of one: OpenAI uses one shape for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(None, exclude_if=lambda v: v is None)
    # vLLM's: a prefill instance's answer says where its KV waits (absent otherwise).
    kv_transfer_params: dict[str, Any] | None = Field(None, exclude_if=lambda v: v is None)


class ChatTopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(ResponseModel):
    name: str
    arguments: str


class ResponseToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    # Omitted when empty / unset, as OpenAI does (its schema has no null for tool_calls).
    tool_calls: list[ResponseToolCall] | None = Field(None, exclude_if=lambda v: not v)
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)  # vLLM's


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = Field(None, exclude_if=lambda v: v is None)


class DeltaFunctionCall(ResponseModel):
    name: str | None = Field(None, exclude_if=lambda v: v is None)
    arguments: str | None = Field(None, exclude_if=lambda v: v is None)


class DeltaToolCall(ResponseModel):
    """A call's fragment: the first carries id, type and name, the next ones arguments."""

    index: int
    id: str | None = Field(None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda v: v is None)
    function: DeltaFunctionCall


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda v: v is None)
    content: str | None = Field(None, exclude_if=lambda v: v is None)
    reasoning_content: str | None = Field(None, exclude_if=lambda v: v is None)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=lambda v: not v)


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    stop_reason: int | str | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = Field(None, exclude_if=lambda v: v is None)


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for a base
    max_model_len: int
    # tokenmill's extra (vLLM has no quantization field): how the linear weights are held,
    # e.g. "int4-g32 (120 linears), bfloat16 lm_head" (docs/quantization.md).
    weight_format: str = ""


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str
