"""POST /v1/chat/completions: messages through the tokenizer's chat template, `n` replies.

A stream opens each choice with a `{"role": "assistant", "content": ""}` delta, as OpenAI does,
then sends content deltas; the last delta of a choice carries its finish_reason.
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
from tokenmill.entrypoints.openai.logprobs import chat_logprobs
from tokenmill.entrypoints.openai.params import (
    chat_params,
    check_stream_options,
    resolve_max_tokens,
)
from tokenmill.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    FinishReason,
    UsageInfo,
)
from tokenmill.entrypoints.openai.streaming import (
    DONE_EVENT,
    EventStreamResponse,
    cancel_on_disconnect,
    sse_event,
)
from tokenmill.outputs import CompletionOutput, PositionLogprobs

logger = logging.getLogger(__name__)


async def create_chat_completion(
    ctx: ServerContext, request: ChatCompletionRequest, raw_request: Request
) -> Response:
    arrival_time = time.time()
    ctx.check_model(request.model)
    log_ignored_fields(request, "/v1/chat/completions")
    check_stream_options(request)
    prompt = ctx.prompts.chat_prompt(request.messages, request.add_generation_prompt)
    if request.max_completion_tokens is not None:
        requested, param = request.max_completion_tokens, "max_completion_tokens"
    else:
        requested, param = request.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(
        requested,
        len(prompt.token_ids),
        ctx.max_model_len,
        param,
        ctx.sampling_defaults.get("max_tokens"),
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    engine_request = EngineRequest(
        request_id,
        prompt.token_ids,
        chat_params(request, max_tokens, ctx.sampling_defaults),
        priority=request.priority,
        cache_salt=request.cache_salt,
    )
    stream = await ctx.engine.add_requests([engine_request], arrival_time)
    run = ChatRun(ctx, request, request_id, len(prompt.token_ids))
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


class ChatRun:
    """The state of one chat request while its engine outputs arrive."""

    def __init__(
        self,
        ctx: ServerContext,
        request: ChatCompletionRequest,
        request_id: str,
        num_prompt_tokens: int,
    ) -> None:
        self.ctx = ctx
        self.request = request
        self.request_id = request_id
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.choices = [_Choice() for _ in range(request.n)]

    async def collect(self, stream: RequestStream) -> ChatCompletionResponse:
        async with stream:
            async for output in stream:
                self.num_cached_tokens = output.num_cached_tokens
                for completion in output.outputs:
                    choice = self.choices[completion.index]
                    choice.text.append(completion.text)
                    choice.token_ids.extend(completion.token_ids)
                    choice.logprobs.extend(completion.logprobs or [])
                    choice.finish_reason = finish_reason(completion)
                    choice.stop_reason = completion.stop_reason
        choices = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(content="".join(choice.text)),
                logprobs=self._logprobs(choice.token_ids, choice.logprobs),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for index, choice in enumerate(self.choices)
        ]
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=self._usage(),
        )

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        try:
            async with stream:
                for index in range(self.request.n):
                    opening = DeltaMessage(role="assistant", content="")
                    yield sse_event(self._chunk([ChatStreamChoice(index=index, delta=opening)]))
                async for output in stream:
                    self.num_cached_tokens = output.num_cached_tokens
                    for completion in output.outputs:
                        yield sse_event(self._chunk([self._stream_choice(completion)]))
            if self.request.stream_options and self.request.stream_options.include_usage:
                yield sse_event(self._chunk([], usage=True))
        except Exception as e:
            logger.warning("chat stream %s failed: %r", self.request_id, e)
            yield error_event(e)
        yield DONE_EVENT

    def _stream_choice(self, completion: CompletionOutput) -> ChatStreamChoice:
        self.choices[completion.index].token_ids.extend(completion.token_ids)
        reason = finish_reason(completion)
        content = completion.text if completion.text or reason is None else None
        return ChatStreamChoice(
            index=completion.index,
            delta=DeltaMessage(content=content),
            logprobs=self._logprobs(completion.token_ids, completion.logprobs or []),
            finish_reason=reason,
            stop_reason=completion.stop_reason,
        )

    def _logprobs(
        self, token_ids: list[int], positions: list[PositionLogprobs]
    ) -> ChatLogprobs | None:
        if not self.request.logprobs:
            return None
        num_top = self.request.top_logprobs or 0
        return ChatLogprobs(
            content=chat_logprobs(self.ctx.tokenizer, token_ids, positions, num_top)
        )

    def _chunk(self, choices: list[ChatStreamChoice], usage: bool = False) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=self._usage() if usage else None,
        )

    def _usage(self) -> UsageInfo:
        return make_usage(
            self.num_prompt_tokens,
            sum(len(c.token_ids) for c in self.choices),
            self.num_cached_tokens,
        )
