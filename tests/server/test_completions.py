"""POST /v1/completions through the official openai client, against a real server."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import MODEL

PROMPT = "The quick brown fox"


def a_token(http: httpx.Client) -> tuple[int, str]:
    """Some token's id and text."""
    token_id = http.post("/tokenize", json={"prompt": " the"}).json()["tokens"][-1]
    return token_id, http.post("/detokenize", json={"tokens": [token_id]}).json()["prompt"]


def greedy(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 12, **kwargs):
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kwargs
    )


def test_completion_has_openai_shape_and_usage(client: openai.OpenAI) -> None:
    completion = greedy(client, PROMPT, max_tokens=5, extra_body={"ignore_eos": True})
    assert completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    assert completion.model == MODEL
    [choice] = completion.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    usage = completion.usage
    assert usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + 5
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_deltas_concatenate_to_the_whole_text(client: openai.OpenAI) -> None:
    whole = greedy(client, PROMPT, max_tokens=16)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_include_usage_adds_a_final_usage_only_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[PROMPT, "Hello"],
            n=2,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *content, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None and len(c.choices) == 1 for c in content)
    prompt_tokens = sum(
        greedy(client, p, max_tokens=1).usage.prompt_tokens for p in [PROMPT, "Hello"]
    )
    assert last.usage.prompt_tokens == prompt_tokens  # each prompt once, not n times
    assert last.usage.completion_tokens == 2 * 2 * 4
    assert last.usage.total_tokens == prompt_tokens + 16
    assert {c.choices[0].index for c in content} == {0, 1, 2, 3}


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(
    client: openai.OpenAI,
) -> None:
    """vLLM's `continuous_usage_stats` (sent by guidellm and aiperf): a chunk carries its
    prompt's tokens and its choice's tokens so far; the last chunk still sums everything."""
    prompts = [PROMPT, "Hello"]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompts, n=2, max_tokens=4, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    *content, last = chunks
    prompt_tokens = [greedy(client, p, max_tokens=1).usage.prompt_tokens for p in prompts]
    counts = {index: 0 for index in range(4)}
    for chunk in content:
        index = chunk.choices[0].index
        assert chunk.usage.prompt_tokens == prompt_tokens[index // 2]
        assert chunk.usage.completion_tokens > counts[index]  # one token per step here
        counts[index] = chunk.usage.completion_tokens
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + counts[index]
    assert counts == {index: 4 for index in range(4)}
    assert last.choices == [] and last.usage.completion_tokens == 16


def test_n_samples_are_distinct_choices(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, n=3, max_tokens=12, temperature=1.0, seed=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len({c.text for c in completion.choices}) == 3
    assert completion.usage.completion_tokens == 3 * 12


def test_list_of_prompts_with_n_orders_choices_prompt_major(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "Hello world"]
    completion = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0
    )
    texts = [c.text for c in sorted(completion.choices, key=lambda c: c.index)]
    first, second = (greedy(client, p, max_tokens=8).choices[0].text for p in prompts)
    assert texts == [first, first, second, second]


def test_token_id_prompts_match_text_prompts(client: openai.OpenAI, http: httpx.Client) -> None:
    token_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = greedy(client, PROMPT).choices[0].text
    assert greedy(client, token_ids).choices[0].text == by_text
    batch = greedy(client, [token_ids, token_ids]).choices
    assert [c.text for c in batch] == [by_text, by_text]


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    text = greedy(client, PROMPT, max_tokens=16).choices[0].text
    stop = text[4:7]
    assert "\ufffd" not in stop, "pick a prompt whose greedy text has plain characters here"
    stopped = greedy(client, PROMPT, max_tokens=16, stop=[stop]).choices[0]
    assert stopped.text == text[: text.index(stop)]
    assert stopped.finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == stopped.text


def test_stop_null_and_unknown_fields_are_accepted(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stop": None, "x_unknown": [1]}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text


def test_logprobs_describe_each_generated_token(client: openai.OpenAI) -> None:
    choice = greedy(client, PROMPT, max_tokens=6, logprobs=3).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0
        assert 3 <= len(top) <= 4  # the top 3, plus the sampled token if not among them
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely
        assert top[token] == pytest.approx(logprob)


def test_echo_with_logprobs_and_zero_max_tokens_scores_the_prompt(client: openai.OpenAI) -> None:
    """How lm-evaluation-harness computes log-likelihoods."""
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = completion.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == completion.usage.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(top is not None and len(top) >= 1 for top in logprobs.top_logprobs[1:])


def test_echo_prepends_the_prompt_whole_and_streamed(client: openai.OpenAI) -> None:
    plain = greedy(client, PROMPT, max_tokens=4).choices[0].text
    echoed = greedy(client, PROMPT, max_tokens=4, echo=True).choices[0]
    assert echoed.text == PROMPT + plain
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=0,
        stream=True,
    )  # fmt: skip
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + plain
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_same_seed_same_sample_other_seed_other_sample(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        completion = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed
        )
        return completion.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_sampling_knobs_reach_the_engine(client: openai.OpenAI, http: httpx.Client) -> None:
    forced, text = a_token(http)
    completion = greedy(
        client, PROMPT, max_tokens=5, logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True, "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.0},
    )  # fmt: skip
    assert completion.choices[0].text == text * 5
    # min_tokens masks stop tokens until it is reached, however strongly they are biased.
    held_back = greedy(
        client, PROMPT, max_tokens=5, logit_bias={str(forced): 100}, frequency_penalty=2.0,
        presence_penalty=2.0, extra_body={"min_tokens": 5, "stop_token_ids": [forced]},
    )  # fmt: skip
    assert held_back.choices[0].finish_reason == "length"
    assert held_back.usage.completion_tokens == 5
    assert held_back.choices[0].text != text * 5


def test_stop_token_ids_end_the_completion(client: openai.OpenAI, http: httpx.Client) -> None:
    forced, _ = a_token(http)
    completion = greedy(
        client, PROMPT, max_tokens=8, logit_bias={str(forced): 100},
        extra_body={"stop_token_ids": [forced]},
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert completion.usage.completion_tokens == 1
    assert choice.model_extra["stop_reason"] == forced


def test_a_repeated_prompt_reports_its_cached_tokens(client: openai.OpenAI) -> None:
    prompt = " ".join(f"item {i}" for i in range(40))  # several KV blocks long
    first = greedy(client, prompt, max_tokens=2)
    second = greedy(client, prompt, max_tokens=2)
    assert second.choices[0].text == first.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens  # whole blocks, never the last token
