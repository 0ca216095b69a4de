"""POST /v1/completions: one or more prompts, `n` samples each, whole or streamed.

Choice `i * n + j` is sample j of prompt i, as in vLLM. With `echo` the prompt is prepended
to each choice's text (and, with `logprobs`, its tokens' logprobs, the first one null).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_engine import EngineRequest, RequestStream
from tokenmill.entrypoints.openai.context import (
    ServerContext,
    finish_reason,
    log_ignored_fields,
    make_usage,
)
from tokenmill.entrypoints.openai.errors import error_event
from tokenmill.entrypoints.openai.inputs import Prompt
from tokenmill.entrypoints.openai.logprobs import completion_logprobs, extend_completion_logprobs
from tokenmill.entrypoints.openai.params import (
    check_stream_options,
    completion_params,
    resolve_max_tokens,
)
from tokenmill.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FinishReason,
)
from tokenmill.entrypoints.openai.streaming import (
    DONE_EVENT,
    EventStreamResponse,
    cancel_on_disconnect,
    sse_event,
)
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput

logger = logging.getLogger(__name__)


async def create_completion(
    ctx: ServerContext, request: CompletionRequest, raw_request: Request
) -> Response:
    arrival_time = time.time()
    ctx.check_model(request.model)
    log_ignored_fields(request, "/v1/completions")
    check_stream_options(request)
    prompts = ctx.prompts.completion_prompts(request.prompt, request.add_special_tokens)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    engine_requests = [
        EngineRequest(
            f"{request_id}-{i}",
            prompt.token_ids,
            completion_params(
                request,
                resolve_max_tokens(
                    request.max_tokens,
                    len(prompt.token_ids),
                    ctx.max_model_len,
                    "max_tokens",
                    ctx.sampling_defaults.get("max_tokens"),
                ),
                ctx.sampling_defaults,
            ),
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        for i, prompt in enumerate(prompts)
    ]
    stream = await ctx.engine.add_requests(engine_requests, arrival_time)
    run = CompletionRun(ctx, request, request_id, prompts)
    if request.stream:
        return EventStreamResponse(run.events(stream))
    response = await cancel_on_disconnect(raw_request, run.collect(stream))
    if response is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(response.model_dump())


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # where the next logprob token starts in the returned text
    echoed: bool = False


@dataclass
class _PromptState:
    prompt: Prompt
    logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    held: list[RequestOutput] = field(default_factory=list)  # outputs waiting for the echo


class CompletionRun:
    """The state of one completions request while its engine outputs arrive."""

    def __init__(
        self, ctx: ServerContext, request: CompletionRequest, request_id: str, prompts: list[Prompt]
    ) -> None:
        self.ctx = ctx
        self.request = request
        self.request_id = request_id
        self.created = int(time.time())
        self.prompts = [_PromptState(p) for p in prompts]
        self.choices = [_Choice() for _ in range(len(prompts) * request.n)]
        self.echo = bool(request.echo)

    # ---- whole ---------------------------------------------------------------------------

    async def collect(self, stream: RequestStream) -> CompletionResponse:
        async with stream:
            async for output in stream:
                prompt_index = self._absorb_prompt(output)
                for completion in output.outputs:
                    choice = self.choices[prompt_index * self.request.n + completion.index]
                    choice.text.append(completion.text)
                    choice.token_ids.extend(completion.token_ids)
                    choice.logprobs.extend(completion.logprobs or [])
                    choice.finish_reason = finish_reason(completion)
                    choice.stop_reason = completion.stop_reason
        return self._response(
            [self._whole_choice(i, choice) for i, choice in enumerate(self.choices)],
            usage=True,
        )

    def _whole_choice(self, index: int, choice: _Choice) -> CompletionChoice:
        prefix, logprobs = self._echo(index, choice)
        if self.request.logprobs is not None:
            logprobs = logprobs or _empty_logprobs()
            generated = self._logprobs(choice, choice.token_ids, choice.logprobs)
            extend_completion_logprobs(logprobs, generated)
        return CompletionChoice(
            index=index,
            text=prefix + "".join(choice.text),
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )

    # ---- streamed ------------------------------------------------------------------------

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        try:
            async with stream:
                async for output in stream:
                    for chunk in self._chunks(output):
                        yield sse_event(chunk)
            if self.request.stream_options and self.request.stream_options.include_usage:
                yield sse_event(self._response([], usage=True))
        except Exception as e:
            logger.warning("completion stream %s failed: %r", self.request_id, e)
            yield error_event(e)
        yield DONE_EVENT

    def _chunks(self, output: RequestOutput) -> list[CompletionResponse]:
        prompt_index = self._absorb_prompt(output)
        state = self.prompts[prompt_index]
        if self._waiting_for_prompt_logprobs(state):
            state.held.append(output)
            return []
        ready, state.held = [*state.held, output], []
        return [self._chunk(prompt_index, c) for o in ready for c in o.outputs]

    def _chunk(self, prompt_index: int, completion: CompletionOutput) -> CompletionResponse:
        index = prompt_index * self.request.n + completion.index
        choice = self.choices[index]
        choice.token_ids.extend(completion.token_ids)
        prefix, logprobs = self._echo(index, choice)
        if self.request.logprobs is not None:
            logprobs = logprobs or _empty_logprobs()
            new = self._logprobs(choice, completion.token_ids, completion.logprobs or [])
            extend_completion_logprobs(logprobs, new)
        delta = CompletionChoice(
            index=index,
            text=prefix + completion.text,
            logprobs=logprobs,
            finish_reason=finish_reason(completion),
            stop_reason=completion.stop_reason,
        )
        return self._response([delta], usage=False)

    def _waiting_for_prompt_logprobs(self, state: _PromptState) -> bool:
        """Streamed echo sends the prompt first, so with logprobs it waits for the prompt's."""
        wanted = self.echo and self.request.logprobs is not None
        return wanted and state.logprobs is None

    # ---- shared --------------------------------------------------------------------------

    def _absorb_prompt(self, output: RequestOutput) -> int:
        prompt_index = int(output.request_id.rsplit("-", 1)[1])
        state = self.prompts[prompt_index]
        state.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            state.logprobs = output.prompt_logprobs
        return prompt_index

    def _echo(self, index: int, choice: _Choice) -> tuple[str, CompletionLogprobs | None]:
        """The prompt's text and logprobs, once per choice (its first chunk) under `echo`."""
        if not self.echo or choice.echoed:
            return "", None
        choice.echoed = True
        state = self.prompts[index // self.request.n]
        prompt = state.prompt
        if prompt.text is None:
            prompt.text = self.ctx.tokenizer.decode(prompt.token_ids)
        if self.request.logprobs is None:
            return prompt.text, None
        logprobs = state.logprobs or [None] * len(prompt.token_ids)
        echoed = completion_logprobs(self.ctx.tokenizer, prompt.token_ids, logprobs)
        if echoed.tokens:
            choice.text_offset = echoed.text_offset[-1] + len(echoed.tokens[-1])
        return prompt.text, echoed

    def _logprobs(
        self, choice: _Choice, token_ids: list[int], positions: list[PositionLogprobs]
    ) -> CompletionLogprobs:
        logprobs = completion_logprobs(self.ctx.tokenizer, token_ids, positions, choice.text_offset)
        if logprobs.tokens:
            choice.text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        return logprobs

    def _response(self, choices: list[CompletionChoice], usage: bool) -> CompletionResponse:
        response = CompletionResponse(
            id=self.request_id, created=self.created, model=self.ctx.model_name, choices=choices
        )
        if usage:
            response.usage = make_usage(
                sum(len(s.prompt.token_ids) for s in self.prompts),
                sum(len(c.token_ids) for c in self.choices),
                sum(s.num_cached_tokens for s in self.prompts),
            )
        return response


def _empty_logprobs() -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
