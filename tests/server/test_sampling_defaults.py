"""Request fields left unset take the model's generation_config.json defaults; set ones win."""

from __future__ import annotations

from tokenmill.entrypoints.http.openai.params import (
    chat_params,
    completion_params,
    resolve_max_tokens,
)
from tokenmill.entrypoints.http.openai.protocol import ChatCompletionRequest, CompletionRequest

MODEL_DEFAULTS = {"temperature": 0.2, "top_k": 20}
MESSAGES = [{"role": "user", "content": "Hi"}]


def test_unset_fields_take_the_model_defaults() -> None:
    chat = chat_params(ChatCompletionRequest(messages=MESSAGES), 8, MODEL_DEFAULTS)
    completion = completion_params(CompletionRequest(prompt="Hi"), 8, MODEL_DEFAULTS)
    for params in (chat, completion):
        assert (params.temperature, params.top_k, params.top_p) == (0.2, 20, 1.0)


def test_request_values_win_and_null_means_default() -> None:
    request = ChatCompletionRequest(messages=MESSAGES, temperature=0.9, top_k=None, top_p=0.5)
    params = chat_params(request, 8, MODEL_DEFAULTS)
    assert (params.temperature, params.top_k, params.top_p) == (0.9, 20, 0.5)


def test_without_model_defaults_openai_defaults_apply() -> None:
    params = chat_params(ChatCompletionRequest(messages=MESSAGES), 8, {})
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 0, 1.0)


def test_model_max_new_tokens_caps_requests_that_set_no_max_tokens() -> None:
    assert resolve_max_tokens(None, 10, 100, "max_tokens", model_default=32) == 32
    assert resolve_max_tokens(None, 80, 100, "max_tokens", model_default=32) == 20
    assert resolve_max_tokens(50, 10, 100, "max_tokens", model_default=32) == 50
    assert resolve_max_tokens(None, 10, 100, "max_tokens") == 90
