"""What /v1/completions and /v1/chat/completions share: checking a request on arrival, handing
its engine requests over, and turning the outputs into one response or a stream of chunks.

An endpoint subclasses `GenerationRun` with how its choices and chunks look; the engine round
trip, the collect loop, the stream loop, usage and error handling live here once.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.intake import EngineRequest
from tokenmill.entrypoints.http.context import (
    ServerContext,
    finish_reason,
    log_ignored_fields,
    make_usage,
)
from tokenmill.entrypoints.http.openai.inputs import Prompt
from tokenmill.entrypoints.http.openai.params import check_stream_options, resolve_max_tokens
from tokenmill.entrypoints.http.openai.protocol import (
    ChatCompletionChunk,
    CompletionResponse,
    FinishReason,
    ResponseModel,
    SamplingRequest,
    UsageInfo,
)
from tokenmill.entrypoints.http.transport.errors import SERVER_ERROR, OpenAIError, error_event
from tokenmill.entrypoints.http.transport.streaming import (
    DONE_EVENT,
    EventStreamResponse,
    cancel_on_disconnect,
    sse_event,
)
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.structured_output import StructuredOutputsParams

logger = logging.getLogger(__name__)

RequestT = TypeVar("RequestT", bound=SamplingRequest)
Chunk = ChatCompletionChunk | CompletionResponse


def begin_request(ctx: ServerContext, request: SamplingRequest, endpoint: str) -> float:
    """The checks every generation request gets before its prompt is read; its arrival time."""
    arrival_time = time.time()
    ctx.check_model(request.model)
    log_ignored_fields(request, endpoint)
    check_stream_options(request)
    return arrival_time


@dataclass
class ChoiceState:
    """One choice as its outputs arrive."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    def add(self, completion: CompletionOutput) -> None:
        self.text.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        self.logprobs.extend(completion.logprobs or [])
        self.finish_reason = finish_reason(completion)
        self.stop_reason = completion.stop_reason


@dataclass
class PromptState:
    """One prompt (one engine request) and what its outputs told about it."""

    prompt: Prompt
    logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # a KV connector's, once finished


class GenerationRun(ABC, Generic[RequestT]):
    """The state of one generation request while its engine outputs arrive.

    Prompt `i` is engine request `{request_id}-{i}`; its `n` samples are choices
    `i * n .. i * n + n - 1`.
    """

    endpoint: str  # for log lines
    input_param: str  # the request field holding the input: "prompt" or "messages"

    def __init__(
        self, ctx: ServerContext, request: RequestT, request_id: str, prompts: list[Prompt]
    ) -> None:
        self.ctx = ctx
        self.request = request
        self.request_id = request_id
        self.created = int(time.time())
        self.prompts = [PromptState(p) for p in prompts]
        self.choices = [self.new_choice() for _ in range(len(prompts) * request.n)]
        self._prompt_index = {self._engine_request_id(i): i for i in range(len(prompts))}
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(
            options and options.continuous_usage_stats
        )

    # ---- what an endpoint defines --------------------------------------------------------

    def new_choice(self) -> ChoiceState:
        return ChoiceState()

    @abstractmethod
    def sampling_params(self, prompt: Prompt) -> SamplingParams:
        """The engine's parameters for one prompt (raises on bad input, before any work)."""

    @abstractmethod
    def response(self) -> ResponseModel:
        """The whole response, once every choice has finished."""

    @abstractmethod
    def chunks(self, prompt_index: int, output: RequestOutput) -> list[Chunk]:
        """The stream chunks for one engine output (none while an output is held back)."""

    @abstractmethod
    def usage_chunk(self) -> Chunk:
        """The last chunk under `stream_options.include_usage`: no choices, the usage."""

    # ---- the shared path -----------------------------------------------------------------

    async def serve(self, raw_request: Request, arrival_time: float) -> Response:
        """Queue the engine requests, then answer with the whole response or a stream."""
        stream = await self.start(raw_request, arrival_time)
        if stream is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if self.request.stream:
            return EventStreamResponse(self.events(stream))
        response = await cancel_on_disconnect(raw_request, self.collect(stream))
        if response is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(response.model_dump())

    async def start(self, raw_request: Request, arrival_time: float) -> RequestStream | None:
        """Queue the engine requests once their constraint has compiled (None if the client
        left meanwhile); the stream of their outputs, for `collect` or `chunk_stream` (other
        protocols' adapters call these three themselves)."""
        lora_request = await self.ctx.lora_request(self.request.model)
        engine_requests = [
            EngineRequest(
                self._engine_request_id(i),
                state.prompt.token_ids,
                self.sampling_params(state.prompt),
                arrival_time,
                priority=self.request.priority,
                cache_salt=self.request.cache_salt,
                output_kind=RequestOutputKind.DELTA,  # the run gathers and streams deltas
                lora_request=lora_request,
            )
            for i, state in enumerate(self.prompts)
        ]
        constraint = engine_requests[0].params.structured_outputs  # the request's, every prompt's
        if isinstance(constraint, StructuredOutputsParams):  # a 400 here if it can't be used
            prepared = self.ctx.prepare_structured_outputs(constraint)
            if await cancel_on_disconnect(raw_request, _done(prepared)) is None:
                self.ctx.refused(self.request)  # never queued: let go of what it points at
                return None  # gone while it compiled: its hold released
        return await self.ctx.engine.add_requests(engine_requests)

    def max_tokens(self, prompt: Prompt, requested: int | None, param: str) -> int:
        """`requested` checked against the context left after `prompt` (see params.py)."""
        return resolve_max_tokens(
            requested,
            len(prompt.token_ids),
            self.ctx.max_model_len,
            param,
            self.ctx.sampling_defaults.get("max_tokens"),
            self.input_param,
        )

    async def collect(self, stream: RequestStream) -> ResponseModel:
        async with stream:
            async for output in stream:
                prompt_index = self._absorb_prompt(output)
                for completion in output.outputs:
                    self.choices[prompt_index * self.request.n + completion.index].add(completion)
        return self.response()

    async def events(self, stream: RequestStream) -> AsyncIterator[str]:
        """Server-sent events: the chunks, the usage chunk if asked for, then `[DONE]`; a
        failure after the 200 has gone out is one error event before `[DONE]`."""
        try:
            async with aclosing(self.chunk_stream(stream)) as chunks:  # aborts at once if closed
                async for chunk in chunks:
                    yield sse_event(chunk)
        except Exception as e:
            logger.warning("%s stream %s failed: %r", self.endpoint, self.request_id, e)
            yield error_event(e)
        yield DONE_EVENT

    async def chunk_stream(self, stream: RequestStream) -> AsyncIterator[Chunk]:
        """The chunks, then the usage chunk if asked for; raises what the stream raises."""
        async with stream:
            async for output in stream:
                for chunk in self.chunks(self._absorb_prompt(output), output):
                    yield chunk
        if self.include_usage:
            yield self.usage_chunk()

    def usage(self) -> UsageInfo:
        """The whole request's usage: each prompt once, every choice's tokens."""
        return make_usage(
            sum(len(s.prompt.token_ids) for s in self.prompts),
            sum(len(c.token_ids) for c in self.choices),
            sum(s.num_cached_tokens for s in self.prompts),
            self.ctx.enable_prompt_tokens_details,
        )

    def chunk_usage(self, choice_index: int) -> UsageInfo | None:
        """Under `continuous_usage_stats`, a chunk's usage: its prompt and its choice's tokens
        so far, as vLLM reports it (the final usage chunk still sums every choice)."""
        if not self.continuous_usage:
            return None
        state = self.prompts[choice_index // self.request.n]
        return make_usage(
            len(state.prompt.token_ids),
            len(self.choices[choice_index].token_ids),
            state.num_cached_tokens,
            self.ctx.enable_prompt_tokens_details,
        )

    def _engine_request_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    def kv_transfer_params(self) -> dict[str, Any] | None:
        """A KV connector's params for the response: of a request with one prompt only (a
        prefill instance's answer to the router)."""
        return self.prompts[0].kv_transfer_params if len(self.prompts) == 1 else None

    def _absorb_prompt(self, output: RequestOutput) -> int:
        """Raises the request's failure (a KV transfer that failed) as its error response."""
        if output.error is not None:
            raise OpenAIError(503, output.error.message, SERVER_ERROR, code=output.error.code)
        prompt_index = self._prompt_index[output.request_id]
        state = self.prompts[prompt_index]
        state.num_cached_tokens = output.num_cached_tokens
        state.kv_transfer_params = output.kv_transfer_params or state.kv_transfer_params
        if output.prompt_logprobs is not None:
            state.logprobs = output.prompt_logprobs
        return prompt_index


async def _done(work: Awaitable[None]) -> bool:
    """True once `work` is done: `cancel_on_disconnect` answers None for a client gone."""
    await work
    return True
