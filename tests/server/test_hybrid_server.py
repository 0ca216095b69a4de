"""`tokenmill serve` of a Qwen3.5 (hybrid linear attention) checkpoint with a thinking chat
template (the generation prompt opens `<think>`, as Qwen3.5's does) and `--reasoning-parser
deepseek_r1`: the reply is reasoning, whole and streamed alike."""

from __future__ import annotations

import shutil
from pathlib import Path

from openai import OpenAI
from server_utils import API_KEY, MODEL, start_server, stop_server

THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)


def test_serve_qwen3_5_with_its_reasoning(tiny_checkpoint, tmp_path: Path) -> None:
    source = tiny_checkpoint(
        "qwen3_5",
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_hidden_layers=4,
        head_dim=16,
    )
    checkpoint = shutil.copytree(source, tmp_path / "qwen3_5")
    (checkpoint / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    server = start_server(checkpoint, tmp_path / "server.log", "--reasoning-parser", "deepseek_r1")
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
        fields = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Think, then answer: 2 + 2?"}],
            "max_tokens": 8,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        whole = client.chat.completions.create(**fields)
        message = whole.choices[0].message
        assert whole.usage.completion_tokens == 8
        reasoning = message.model_extra["reasoning_content"]
        assert reasoning and message.content is None  # no `</think>`: all reasoning
        streamed = ""
        for chunk in client.chat.completions.create(stream=True, **fields):
            for choice in chunk.choices:
                streamed += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        assert streamed == reasoning
    finally:
        stop_server(server)
