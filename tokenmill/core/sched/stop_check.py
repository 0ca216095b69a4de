"""Whether a request ends with the token it just sampled (vLLM's `check_stop`), and moving its
grammar past that token."""

from __future__ import annotations

from tokenmill.step.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> None:
    """Finish the request if this token ends it: a stop or EOS token (once `min_tokens` are
    out), `max_tokens`, or `max_model_len`."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
            return
        if not params.ignore_eos and token_id in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED


def advance_grammar(request: Request, token_id: int) -> None:
    """Move the request's matcher past a token; a grammar that has reached its end (say with
    EOS ignored) stops the request."""
    grammar = request.grammar
    assert grammar is not None
    if not grammar.accept_tokens([token_id]):  # the bitmask should make this impossible
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = f"structured output: token {token_id} breaks the grammar"
    elif grammar.is_terminated:
        request.status = RequestStatus.FINISHED_STOPPED
