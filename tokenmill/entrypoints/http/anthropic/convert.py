"""Anthropic bodies <-> the chat path's request and reply, field by field as vLLM's
/v1/messages maps them: system -> a system message, tool_result blocks -> tool messages,
tool_use blocks -> assistant tool_calls, tool_choice any -> required, tool -> a named function;
back: reasoning -> a thinking block, content -> a text block, calls -> tool_use blocks."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.http.anthropic.protocol import (
    AnthropicUsage,
    ContentBlock,
    CountTokensRequest,
    InputMessage,
    MessageResponse,
    MessagesRequest,
    StopReason,
    TextBlock,
    TextContent,
    ThinkingBlock,
    ThinkingContent,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseContent,
)
from tokenmill.entrypoints.http.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from tokenmill.entrypoints.http.transport.errors import bad_request

CHAT_TOOL_ID_PREFIX, TOOL_USE_ID_PREFIX = "chatcmpl-tool-", "toolu_"


def chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that generates (or, for count_tokens, renders) this message."""
    body: dict[str, Any] = {"model": request.model, "messages": _chat_messages(request)}
    if request.tools:
        body["tools"] = [
            _chat_tool(tool.name, tool.description, tool, index)
            for index, tool in enumerate(request.tools)
        ]
    body.update(_tool_choice(request))
    if isinstance(request, MessagesRequest):
        body.update(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stop=request.stop_sequences,
            include_stop_str_in_output=False,
            stream=request.stream,
        )
        if request.stream:
            body["stream_options"] = {"include_usage": True}
    return ChatCompletionRequest.model_validate(body)


def message_response(reply: ChatCompletionResponse, message_id: str) -> MessageResponse:
    choice = reply.choices[0]
    content: list[ContentBlock] = []
    if choice.message.reasoning_content:
        content.append(ThinkingContent(thinking=choice.message.reasoning_content))
    if choice.message.content:
        content.append(TextContent(text=choice.message.content))
    for call in choice.message.tool_calls or []:
        content.append(
            ToolUseContent(
                id=tool_use_id(call.id),
                name=call.function.name,
                input=_call_input(call.function.arguments),
            )
        )
    reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
    return MessageResponse(
        id=message_id,
        model=reply.model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=AnthropicUsage(
            input_tokens=reply.usage.prompt_tokens, output_tokens=reply.usage.completion_tokens
        ),
    )


def _call_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as `input`; a call cut short by max_tokens has arguments that do not
    parse yet: its block is left with an empty input, the reply with stop_reason max_tokens
    (as Anthropic answers a tool_use cut short), not a 500."""
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def stop_reason(finish: str | None, matched: int | str | None) -> tuple[StopReason, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_use_id(chat_id: str) -> str:
    return TOOL_USE_ID_PREFIX + chat_id.removeprefix(CHAT_TOOL_ID_PREFIX)


def _chat_tool(name: str, description: str | None, tool: Any, index: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise bad_request(f"tool type {tool.type!r} is not supported (custom tools only)", "tools")
    if tool.input_schema.get("type") != "object":  # as Anthropic: checked before any work
        raise bad_request(
            "input_schema must be a JSON schema of type 'object'",
            param=f"tools.{index}.input_schema.type",
        )
    function = {"name": name, "parameters": tool.input_schema}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def _tool_choice(request: CountTokensRequest) -> dict[str, Any]:
    choice = request.tool_choice
    if choice is None:
        return {}
    fields: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type tool needs a name", param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


def _chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        messages.append({"role": "system", "content": _text(request.system, "system")})
    for index, message in enumerate(request.messages):
        messages.extend(_convert_message(message, f"messages.{index}.content"))
    return messages


def _convert_message(message: InputMessage, param: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results, reasoning = [], [], [], []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock) and message.role == "assistant":
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ToolResultBlock) and message.role == "user":
            content = _text(block.content or "", param)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, ThinkingBlock) and message.role == "assistant":
            reasoning.append(block.thinking)
        else:
            raise bad_request(
                f"content blocks of type {block.type!r} are not supported in a "
                f"{message.role} message",
                param=param,
            )
    converted: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
    if calls:
        converted["tool_calls"] = calls
    if reasoning:
        converted["reasoning_content"] = "".join(reasoning)
    if results and not texts:
        return results
    return [*results, converted] if results else [converted]


def _text(content: str | list[TextBlock], param: str) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.text for block in content)
