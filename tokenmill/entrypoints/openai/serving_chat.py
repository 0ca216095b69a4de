"""POST /v1/chat/completions: messages through the tokenizer's chat template, `n` replies.

A stream opens each choice with a `{"role": "assistant", "content": ""}` delta, as OpenAI does,
then sends content deltas; the last delta of a choice carries its finish_reason. The opening
deltas go out with the first token, not on acceptance, as vLLM sends them: clients time the
first chunk as the time to first token.
"""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import Response

from tokenmill.entrypoints.openai.context import ServerContext, finish_reason
from tokenmill.entrypoints.openai.inputs import Prompt
from tokenmill.entrypoints.openai.logprobs import chat_logprobs
from tokenmill.entrypoints.openai.params import chat_params
from tokenmill.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from tokenmill.entrypoints.openai.serving import Chunk, GenerationRun, begin_request
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams


async def create_chat_completion(
    ctx: ServerContext, request: ChatCompletionRequest, raw_request: Request
) -> Response:
    arrival_time = begin_request(ctx, request, "/v1/chat/completions")
    prompt = await ctx.off_loop(
        ctx.prompts.chat_prompt, request.messages, request.add_generation_prompt
    )
    run = ChatRun(ctx, request, f"chatcmpl-{uuid.uuid4().hex}", [prompt])
    return await run.serve(raw_request, arrival_time)


class ChatRun(GenerationRun[ChatCompletionRequest]):
    """The state of one chat request (one prompt) while its engine outputs arrive."""

    endpoint = "chat"
    input_param = "messages"
    _opened = False  # whether the stream has sent its opening (role) deltas

    def sampling_params(self, prompt: Prompt) -> SamplingParams:
        request = self.request
        if request.max_completion_tokens is not None:
            requested, param = request.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = request.max_tokens, "max_tokens"
        max_tokens = self.max_tokens(prompt, requested, param)
        return chat_params(request, max_tokens, self.ctx.sampling_defaults)

    def response(self) -> ChatCompletionResponse:
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
            usage=self.usage(),
        )

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[Chunk]:
        opening = [] if self._opened else self._opening_chunks()
        self._opened = True
        return [*opening, *(self._content_chunk(c) for c in output.outputs)]

    def usage_chunk(self) -> ChatCompletionChunk:
        return self._chunk([], self.usage())

    def _opening_chunks(self) -> list[Chunk]:
        opening = DeltaMessage(role="assistant", content="")
        return [
            self._chunk([ChatStreamChoice(index=i, delta=opening)], self.chunk_usage(i))
            for i in range(self.request.n)
        ]

    def _content_chunk(self, completion: CompletionOutput) -> ChatCompletionChunk:
        choice = self._stream_choice(completion)
        return self._chunk([choice], self.chunk_usage(choice.index))

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

    def _chunk(
        self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=usage,
        )
