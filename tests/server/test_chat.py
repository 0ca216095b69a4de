"""POST /v1/chat/completions through the official openai client, against a real server."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import MAX_MODEL_LEN, MODEL

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


def chat(client: openai.OpenAI, messages=MESSAGES, max_tokens: int = 10, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def test_chat_completion_has_openai_shape(client: openai.OpenAI, http: httpx.Client) -> None:
    completion = chat(client, max_tokens=6, extra_body={"ignore_eos": True})
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    [choice] = completion.choices
    assert choice.message.role == "assistant"
    assert choice.message.refusal is None
    assert choice.message.content
    assert choice.finish_reason == "length"
    rendered = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert completion.usage.prompt_tokens == rendered["count"]
    assert completion.usage.completion_tokens == 6


def test_streamed_chat_deltas_concatenate_to_the_whole_reply(client: openai.OpenAI) -> None:
    whole = chat(client, max_tokens=16).choices[0]
    chunks = list(chat(client, max_tokens=16, stream=True))
    first, *rest = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in rest) == whole.message.content
    assert rest[-1].choices[0].finish_reason == whole.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_stream_with_usage_and_n(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, n=3, temperature=1.0, seed=3,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 9
    finished = [c.choices[0].index for c in content if c.choices[0].finish_reason == "length"]
    assert sorted(finished) == [0, 1, 2]


def test_chat_continuous_usage_stats_count_up_from_the_role_chunk(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        chat(
            client, max_tokens=5, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    role, *content, last = chunks
    prompt_tokens = last.usage.prompt_tokens
    assert role.choices[0].delta.role == "assistant"
    assert (role.usage.prompt_tokens, role.usage.completion_tokens) == (prompt_tokens, 0)
    assert [c.usage.completion_tokens for c in content] == [1, 2, 3, 4, 5]
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in content)
    assert last.choices == [] and last.usage.completion_tokens == 5


def test_content_as_text_parts_equals_the_joined_string(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]
    as_parts = chat(client, messages=[{"role": "user", "content": parts}])
    as_string = chat(client, messages=[{"role": "user", "content": "Name a\ncolour."}])
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens


def test_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    choice = chat(client, max_tokens=5, logprobs=True, top_logprobs=3).choices[0]
    content = choice.logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert token.bytes == list(token.token.encode())
        assert len(token.top_logprobs) == 3
        top = [t.logprob for t in token.top_logprobs]
        assert top == sorted(top, reverse=True)
        assert token.top_logprobs[0].token == token.token  # greedy takes the most likely
        assert token.logprob == pytest.approx(top[0])
    assert chat(client, max_tokens=2).choices[0].logprobs is None


def test_streamed_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    chunks = list(chat(client, max_tokens=5, logprobs=True, top_logprobs=1, stream=True))
    tokens = [t for c in chunks[1:] for t in (c.choices[0].logprobs.content or [])]
    whole = chat(client, max_tokens=5, logprobs=True, top_logprobs=1).choices[0]
    assert [t.token for t in tokens] == [t.token for t in whole.logprobs.content]


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    completion = chat(
        client, max_tokens=10, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 3


def test_without_max_tokens_the_reply_may_fill_the_context(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.total_tokens == MAX_MODEL_LEN
    assert completion.choices[0].finish_reason == "length"


def test_chat_stop_strings_and_seeds(client: openai.OpenAI) -> None:
    text = chat(client, max_tokens=16).choices[0].message.content
    stop = text[3:6]
    stopped = chat(client, max_tokens=16, stop=stop).choices[0]
    assert stopped.message.content == text[: text.index(stop)]
    assert stopped.finish_reason == "stop"

    def sample(seed: int) -> str:
        completion = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=seed
        )
        return completion.choices[0].message.content

    assert sample(11) == sample(11) != sample(12)
