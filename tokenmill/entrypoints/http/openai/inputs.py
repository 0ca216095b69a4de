"""Client prompts -> token ids. Whether the model can take them is the engine's one intake's
to check (engine/intake.py); here only what costs the server before that: text too long to
be worth tokenizing, chat messages a template cannot render."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from tokenmill.entrypoints.http.openai.protocol import ChatMessage, ToolCall
from tokenmill.entrypoints.http.transport.body_checks import (
    MAX_JSON_DEPTH,
    InvalidBodyError,
    check_json_depth,
)
from tokenmill.entrypoints.http.transport.errors import bad_request


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # as the client sent it (None for token ids; decoded when echoed)


class PromptBuilder:
    """Tokenizes prompts. Runs on the server's tokenizer thread
    (`ServerContext.off_loop`): the fast tokenizer's Rust core only reads shared state, so the
    engine thread's detokenizing is not disturbed."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # No token spells more than this many UTF-8 bytes (4 per character of the longest
        # vocabulary entry), so a longer text has more than max_model_len tokens for sure,
        # and is refused without spending seconds tokenizing it.
        longest_token = max((len(token) for token in tokenizer.get_vocab()), default=1)
        self.max_text_bytes = max_model_len * 4 * longest_token

    def completion_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]], add_special_tokens: bool
    ) -> list[Prompt]:
        """The four prompt forms OpenAI accepts: a string, strings, token ids, lists of them."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]  # type: ignore[list-item]
        return [
            Prompt(self.encode(p, add_special_tokens), p)
            if isinstance(p, str)
            else Prompt(list(p), None)
            for p in prompt
        ]

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        reasoning_effort: str | None = None,
    ) -> Prompt:
        text = self.render_chat(messages, add_generation_prompt, tools, reasoning_effort)
        return Prompt(self.encode(text, add_special_tokens, "messages"), text)

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        reasoning_effort: str | None = None,
    ) -> str:
        """`tools` (OpenAI's shape) go to the template as transformers passes them;
        `reasoning_effort` as a template variable (gpt-oss's template reads it), where set."""
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template", param="messages")
        check_tool_messages(messages)
        conversation = [_template_message(i, m) for i, m in enumerate(messages)]
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **({} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}),
            )
        except jinja2.TemplateError as e:  # e.g. a template's raise_exception on bad roles
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from e

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        num_bytes = len(text.encode())
        if num_bytes > self.max_text_bytes:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your {param} is {num_bytes} bytes long, more than that many tokens can spell. "
                f"Please reduce the length of the {param}.",
                param=param,
                code="context_length_exceeded",
            )
        # verbose=False: no "Token indices sequence length is longer than..." warning from
        # transformers; a prompt too long for the context is a 400 anyway (max_tokens' rule).
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False)


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: content as one string (text parts joined by
    newlines, as vLLM does), since most templates cannot iterate OpenAI's content parts."""
    content = message.content
    if isinstance(content, list):
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    'content parts must be {"type": "text", "text": "..."}; '
                    f"got type {part.type!r}" + ("" if part.text is not None else " without text"),
                    param=f"messages.{index}.content",
                )
        content = "\n".join(part.text or "" for part in content)
    rendered: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = [
            _template_tool_call(call, f"messages.{index}.tool_calls.{number}.function.arguments")
            for number, call in enumerate(message.tool_calls)
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _template_tool_call(call: ToolCall, param: str) -> dict[str, Any]:
    """Arguments as a mapping (templates write them with `tojson`), as vLLM passes them; text
    that is not a JSON object stays text. Nested deeper than `MAX_JSON_DEPTH`: a 400 (Python's
    json and the template's `tojson` recurse; 5,000 levels was a RecursionError)."""
    try:
        arguments: Any = json.loads(call.function.arguments)
        check_json_depth(arguments, param)
    except (RecursionError, InvalidBodyError):
        message = f"nests objects and arrays more than {MAX_JSON_DEPTH} levels deep"
        raise bad_request(message, param) from None
    except ValueError:
        arguments = call.function.arguments
    if not isinstance(arguments, dict):
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """A tool message answers a call of the assistant message before it (OpenAI's rule)."""
    call_ids: set[str] = set()
    for index, message in enumerate(messages):
        if message.role == "assistant":
            call_ids = {call.id for call in message.tool_calls or []}
        elif message.role == "tool" and message.tool_call_id not in call_ids:
            raise bad_request(
                "messages with role 'tool' must be a response to a preceding message with "
                f"'tool_calls' (tool_call_id {message.tool_call_id!r} answers no call)",
                param=f"messages.{index}.tool_call_id",
            )
