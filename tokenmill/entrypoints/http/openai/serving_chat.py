"""POST /v1/chat/completions: messages (and tools) through the tokenizer's chat template, `n`
replies, each read by the reply parsers (reasoning, tool calls: reply_parsing.py).

A stream opens each choice with a `{"role": "assistant", "content": ""}` delta, as OpenAI does,
then sends reasoning, content and tool-call deltas; the last delta of a choice carries its
finish_reason ("tool_calls" when the reply was calls). The opening deltas go out with the
first token, not on acceptance, as vLLM sends them: clients time the first chunk as the time
to first token.
"""

from __future__ import annotations

import dataclasses
import uuid

from fastapi import Request
from fastapi.responses import Response

from tokenmill.entrypoints.http.context import ServerContext, finish_reason
from tokenmill.entrypoints.http.openai.generation_run import Chunk, GenerationRun, begin_request
from tokenmill.entrypoints.http.openai.inputs import Prompt
from tokenmill.entrypoints.http.openai.logprobs import chat_logprobs
from tokenmill.entrypoints.http.openai.params import chat_params
from tokenmill.entrypoints.http.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatFinishReason,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    FinishReason,
    UsageInfo,
)
from tokenmill.entrypoints.http.replies.reasoning import ReasoningParser
from tokenmill.entrypoints.http.replies.reply_parsing import (
    ReplyStream,
    keeps_special_tokens,
    parse_reply,
)
from tokenmill.entrypoints.http.replies.tool_calling import ToolPlan, plan_tools, template_tools
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


async def create_chat_completion(
    ctx: ServerContext, request: ChatCompletionRequest, raw_request: Request
) -> Response:
    arrival_time = begin_request(ctx, request, "/v1/chat/completions")
    run = await start_chat_run(ctx, request)
    return await run.serve(raw_request, arrival_time)


async def start_chat_run(ctx: ServerContext, request: ChatCompletionRequest) -> ChatRun:
    """The request's tool plan and prompt, checked on the tokenizer thread (a thousand tools
    take milliseconds to plan and render, which the event loop owes other clients); nothing
    is queued yet."""
    plan, prompt = await ctx.off_loop(_plan_and_prompt, ctx, request)
    return ChatRun(ctx, request, f"chatcmpl-{uuid.uuid4().hex}", [prompt], plan)


def _plan_and_prompt(ctx: ServerContext, request: ChatCompletionRequest) -> tuple[ToolPlan, Prompt]:
    options = ctx.reply_parsing
    plan = plan_tools(request, options.enable_auto_tool_choice, options.tool_parser())
    prompt = ctx.prompts.chat_prompt(
        request.messages,
        request.add_generation_prompt,
        tools=template_tools(request),
        reasoning_effort=request.reasoning_effort,
    )
    return plan, prompt


def chat_finish_reason(reason: FinishReason | None, tools_called: bool) -> ChatFinishReason | None:
    return "tool_calls" if tools_called and reason == "stop" else reason


class ChatRun(GenerationRun[ChatCompletionRequest]):
    """The state of one chat request (one prompt) while its engine outputs arrive."""

    endpoint = "chat"
    input_param = "messages"
    _opened = False  # whether the stream has sent its opening (role) deltas

    def __init__(
        self,
        ctx: ServerContext,
        request: ChatCompletionRequest,
        request_id: str,
        prompts: list[Prompt],
        plan: ToolPlan,
    ) -> None:
        super().__init__(ctx, request, request_id, prompts)
        self.plan = plan
        self.reasoning: ReasoningParser | None = ctx.reply_parsing.reasoning()
        self._parses = plan.mode != "none" or self.reasoning is not None
        self._streams = [ReplyStream(plan, self.reasoning) for _ in self.choices]

    def sampling_params(self, prompt: Prompt) -> SamplingParams:
        request = self.request
        if request.max_completion_tokens is not None:
            requested, param = request.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = request.max_tokens, "max_tokens"
        max_tokens = self.max_tokens(prompt, requested, param)
        params = chat_params(request, max_tokens, self.ctx.sampling_defaults)
        if self.plan.constraint is not None:
            params = dataclasses.replace(params, structured_outputs=self.plan.constraint)
        if keeps_special_tokens(self.plan, self.reasoning):
            params = dataclasses.replace(params, skip_special_tokens=False)
        constraint = params.structured_outputs
        reasoning = self.reasoning
        # As vLLM: the reasoning is free, the constraint starts where it ends.
        if (
            isinstance(constraint, StructuredOutputsParams)
            and reasoning is not None
            and not reasoning.ended_in_prompt(prompt.text or "")
        ):
            constraint = dataclasses.replace(constraint, reasoning_end=reasoning.end_tag)
            params = dataclasses.replace(params, structured_outputs=constraint)
        return params

    def response(self) -> ChatCompletionResponse:
        choices = []
        for index, choice in enumerate(self.choices):
            reply = parse_reply("".join(choice.text), self.plan, self.reasoning)
            message = ChatResponseMessage(
                content=reply.content,
                tool_calls=reply.tool_calls,
                reasoning_content=reply.reasoning_content,
            )
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=self._logprobs(choice.token_ids, choice.logprobs),
                    finish_reason=chat_finish_reason(choice.finish_reason, bool(reply.tool_calls)),
                    stop_reason=choice.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.ctx.reported_model(self.request.model),
            choices=choices,
            usage=self.usage(),
            kv_transfer_params=self.kv_transfer_params(),
        )

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[Chunk]:
        opening = [] if self._opened else self._opening_chunks()
        self._opened = True
        return [*opening, *(c for out in output.outputs for c in self._content_chunks(out))]

    def usage_chunk(self) -> ChatCompletionChunk:
        return self._chunk([], self.usage())

    def _opening_chunks(self) -> list[Chunk]:
        opening = DeltaMessage(role="assistant", content="")
        return [
            self._chunk([ChatStreamChoice(index=i, delta=opening)], self.chunk_usage(i))
            for i in range(self.request.n)
        ]

    def _content_chunks(self, completion: CompletionOutput) -> list[ChatCompletionChunk]:
        """A completion's deltas as chunks; the first carries its logprobs, the last its
        finish_reason. None while the parsers hold the text back (a call being written)."""
        index = completion.index
        self.choices[index].token_ids.extend(completion.token_ids)
        reason = finish_reason(completion)
        stream = self._streams[index]
        deltas = stream.feed(completion.text)
        if reason is not None:
            deltas += stream.finish()
        logprobs = self._logprobs(completion.token_ids, completion.logprobs or [])
        if not deltas:
            if self._parses and reason is None and logprobs is None:
                return []
            deltas = [DeltaMessage(content="" if reason is None else None)]
        usage = self.chunk_usage(index)
        chunks = [
            self._chunk([ChatStreamChoice(index=index, delta=delta)], usage) for delta in deltas
        ]
        chunks[0].choices[0].logprobs = logprobs
        last = chunks[-1].choices[0]
        last.finish_reason = chat_finish_reason(reason, stream.tools_called)
        last.stop_reason = completion.stop_reason
        return chunks

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
            model=self.ctx.reported_model(self.request.model),
            choices=choices,
            usage=usage,
        )
