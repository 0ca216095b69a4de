"""`tokenmill serve` of a mixture-of-experts checkpoint: the OpenAI SDK's chat completions
(streamed and not, with tools offered) and the Anthropic SDK's messages both answer."""

from __future__ import annotations

from pathlib import Path

from anthropic import Anthropic
from openai import OpenAI
from server_utils import API_KEY, MODEL, start_server, stop_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two whole numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def test_serve_an_moe_checkpoint_to_both_sdks(tiny_checkpoint, tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint(
        "qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    server = start_server(
        checkpoint,
        tmp_path / "server.log",
        "--max-model-len",
        "1024",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    try:
        openai = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
        messages = [{"role": "user", "content": "What is 12 times 3?"}]
        reply = openai.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
        )
        assert reply.usage.completion_tokens > 0
        assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
        plain = openai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0
        )
        stream = openai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        chunks = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        assert "".join(chunks) == plain.choices[0].message.content
        anthropic = Anthropic(base_url=server.url, api_key=API_KEY)
        message = anthropic.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}]
        )
        assert message.usage.output_tokens > 0
    finally:
        stop_server(server)
