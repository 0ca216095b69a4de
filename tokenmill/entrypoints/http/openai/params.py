"""OpenAI request fields -> `SamplingParams`, with vLLM's context-length rule for max_tokens."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.http.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from tokenmill.entrypoints.http.replies.structured_outputs import structured_outputs_params
from tokenmill.entrypoints.http.transport.errors import bad_request, context_length_error
from tokenmill.sampling_params import SamplingParams

# Request fields whose null means "the default", and SamplingParams' default for each.
_NULLABLE_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    param: str,
    model_default: int | None = None,
    input_param: str = "prompt",
) -> int:
    """The tokens to generate: as requested, or (null) the rest of the context, capped by the
    model's `max_new_tokens` if its generation_config.json sets one; a 400 when the prompt and
    the request together exceed the context, as vLLM answers. `input_param` names the input
    (`prompt` or `messages`) in the error."""
    room = max_model_len - num_prompt_tokens
    if room < 0 or (room == 0 and requested is None):  # the prompt alone leaves no room
        raise context_length_error(num_prompt_tokens, None, max_model_len, input_param)
    if requested is None:
        return room if model_default is None else min(room, model_default)
    if requested < 0:
        raise bad_request(f"{param} must be >= 0, got {requested}", param=param)
    if requested > room:
        raise context_length_error(num_prompt_tokens, requested, max_model_len, param, input_param)
    return requested


def completion_params(
    request: CompletionRequest, max_tokens: int, model_defaults: dict[str, float]
) -> SamplingParams:
    if request.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of is not supported (other than best_of == n)", "best_of")
    logprobs = request.logprobs
    return _sampling_params(
        request,
        model_defaults,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=logprobs if request.echo and logprobs is not None else None,
    )


def chat_params(
    request: ChatCompletionRequest, max_tokens: int, model_defaults: dict[str, float]
) -> SamplingParams:
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return _sampling_params(request, model_defaults, max_tokens=max_tokens, logprobs=logprobs)


def check_stream_options(request: SamplingRequest) -> None:
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


def _sampling_params(
    request: SamplingRequest, model_defaults: dict[str, float], **fields: Any
) -> SamplingParams:
    """A field the request leaves unset (or null) takes the model's default from its
    generation_config.json, else SamplingParams' own, as vLLM does."""
    for name, default in _NULLABLE_DEFAULTS.items():
        value = getattr(request, name)
        fields[name] = model_defaults.get(name, default) if value is None else value
    return SamplingParams(
        n=request.n,
        seed=request.seed,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        logit_bias=_logit_bias(request.logit_bias),
        skip_special_tokens=request.skip_special_tokens,
        structured_outputs=structured_outputs_params(request),
        extra_args=None
        if request.kv_transfer_params is None
        else {"kv_transfer_params": request.kv_transfer_params},
        **fields,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI keys token ids as JSON strings."""
    if bias is None:
        return None
    try:
        return {int(token_id): value for token_id, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids", param="logit_bias") from None
