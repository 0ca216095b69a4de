"""Responses bodies <-> the chat path: `instructions` + the stored conversation + `input` items
become chat messages (a `function_call` item an assistant `tool_calls` entry, a
`function_call_output` a `tool` message); the chat reply becomes output items (`reasoning`,
`message` with `output_text`, `function_call`)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from tokenmill.entrypoints.http.openai.protocol import ChatCompletionRequest, ChatCompletionResponse
from tokenmill.entrypoints.http.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputText,
    MessageItem,
    ResponsesRequest,
)
from tokenmill.entrypoints.http.transport.errors import bad_request


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own turns as chat messages (without instructions or history)."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(request.input):
        param = f"input.{index}"
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content, param)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
                messages[-1].setdefault("tool_calls", []).append(call)  # parallel calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = _text(item.output, param)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif item.type != "reasoning":  # earlier reasoning is not read back, as in vLLM
            raise bad_request(f"input items of type {item.type!r} are not supported", param)
    return messages


def chat_request(
    request: ResponsesRequest, messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "stream": request.stream,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["reasoning_effort"] = request.reasoning.effort
    if request.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(request.tools)]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else {"type": "function", "function": {"name": choice.name}}
        )
    response_format = _response_format(request)
    if response_format is not None:
        body["response_format"] = response_format
    return ChatCompletionRequest.model_validate(body)


def output_items(reply: ChatCompletionResponse) -> list[dict[str, Any]]:
    message = reply.choices[0].message
    items = []
    if message.reasoning_content:
        items.append(reasoning_item(new_id("rs"), message.reasoning_content))
    if message.content:
        items.append(message_item(new_id("msg"), message.content))
    for call in message.tool_calls or []:
        items.append(
            function_call_item(
                new_id("fc"), response_call_id(call.id), call.function.name, call.function.arguments
            )
        )
    return items


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reply as chat messages, for the conversation a later `previous_response_id` reads."""
    text = "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"])
    calls = [
        {
            "id": i["call_id"],
            "type": "function",
            "function": {"name": i["name"], "arguments": i["arguments"]},
        }
        for i in items
        if i["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def response_object(
    request: ResponsesRequest,
    response_id: str,
    model: str,
    created_at: float,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete: bool = False,
) -> dict[str, Any]:
    response = {
        "id": response_id,
        "object": "response",
        "created_at": int(created_at),
        "status": status,
        "model": model,
        "output": output,
        "usage": usage,
        "instructions": request.instructions,
        "tools": [_tool_echo(tool) for tool in request.tools or []],
        "tool_choice": _tool_choice_echo(request),
        "parallel_tool_calls": bool(request.parallel_tool_calls),
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "metadata": request.metadata or {},
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "completed_at": int(time.time()) if status == "completed" else None,
    }
    if usage is None:  # not known yet (a stream's first events): left out, as OpenAI does
        del response["usage"]
    return response


def usage_object(num_input: int, num_output: int, num_cached: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": num_input,
        "input_tokens_details": {"cached_tokens": num_cached},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": num_input + num_output,
    }


def _tool_echo(tool: Any) -> dict[str, Any]:
    """A function tool as OpenAI echoes it: every field, `strict` and `parameters` included."""
    return {
        "type": tool.type,
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }


def _tool_choice_echo(request: ResponsesRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}


def response_call_id(chat_id: str) -> str:
    return "call_" + chat_id.removeprefix("chatcmpl-tool-")


def _chat_tool(tool: Any, index: int) -> dict[str, Any]:
    if tool.type != "function" or tool.name is None:
        raise bad_request(
            f"tools of type {tool.type!r} are not supported (function tools with a name only)",
            param=f"tools.{index}",
        )
    function = {"name": tool.name, "parameters": tool.parameters}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    text_format = request.text.format if request.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": text_format.name or "output", "schema": text_format.schema_}
    return {"type": "json_schema", "json_schema": {**schema, "strict": text_format.strict}}


def _text(content: str | list[InputText], param: str) -> str:
    if isinstance(content, str):
        return content
    for part in content:
        if part.type not in ("input_text", "output_text") or part.text is None:
            raise bad_request(f"content parts of type {part.type!r} are not supported", param)
    return "".join(part.text or "" for part in content)
