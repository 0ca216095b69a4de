"""`--reasoning-parser deepseek_r1` on the demo model: its template does not close a `<think>`,
so as for an R1 model cut off mid-thought, the reply is reasoning_content, whole and streamed
alike (recorded splits of every parser: tests/unit/test_reasoning_parsers.py; constrained
replies after the reasoning: test_reasoning_grammar.py and
tests/model/test_grammar_after_reasoning.py)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_clients import openai_client
from server_utils import API_KEY, Server, start_server, stop_server

from tokenmill.demo import DEMO_TARGET_NAME

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def reasoning_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log_path = tmp_path_factory.mktemp("reasoning") / "server.log"
    server: Server = start_server(None, log_path, "--reasoning-parser", "deepseek_r1")
    yield openai_client(server)
    stop_server(server)


def test_an_unclosed_think_is_all_reasoning_whole_and_streamed(reasoning_client) -> None:
    fields = {"model": DEMO_TARGET_NAME, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    whole = reasoning_client.chat.completions.create(**fields)
    message = whole.choices[0].message
    assert message.content is None
    assert message.model_extra["reasoning_content"]
    reasoning, content = "", ""
    for chunk in reasoning_client.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert reasoning == message.model_extra["reasoning_content"]
    assert content == ""


def test_reasoning_is_a_thinking_block_in_the_messages_api(reasoning_client) -> None:
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(
        base_url=str(reasoning_client.base_url).removesuffix("/v1/"), api_key=API_KEY
    )
    body = {"model": DEMO_TARGET_NAME, "max_tokens": 12, "messages": MESSAGES}
    body["extra_body"] = {"temperature": 0}
    message = claude.messages.create(**body)
    assert [block.type for block in message.content] == ["thinking"]
    with claude.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking"
    assert final.content[0].thinking == message.content[0].thinking
