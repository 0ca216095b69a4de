"""POST /tokenize and /detokenize: the served model's tokenizer, as vLLM exposes it."""

from __future__ import annotations

from tokenmill.entrypoints.http.context import ServerContext, log_ignored_fields
from tokenmill.entrypoints.http.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenmill.entrypoints.http.transport.errors import bad_request


def tokenize_prompt(ctx: ServerContext, request: TokenizeRequest) -> TokenizeResponse:
    """A prompt as completions would encode it, or messages as chat would render them."""
    ctx.check_model(request.model)
    log_ignored_fields(request, "/tokenize")
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("give either prompt or messages", param="prompt")
    if request.messages is not None:
        text = ctx.prompts.render_chat(request.messages, request.add_generation_prompt)
        add_special_tokens = bool(request.add_special_tokens)
    else:
        text = request.prompt or ""
        add_special_tokens = request.add_special_tokens is not False
    tokens = ctx.prompts.encode(
        text, add_special_tokens, "prompt" if request.messages is None else "messages"
    )
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=ctx.max_model_len,
        tokens=tokens,
        token_strs=ctx.tokenizer.convert_ids_to_tokens(tokens)
        if request.return_token_strs
        else None,
    )


def detokenize_tokens(ctx: ServerContext, request: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(request.model)
    log_ignored_fields(request, "/detokenize")
    vocab_size = ctx.prompts.vocab_size
    bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens"
        )
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(request.tokens))
