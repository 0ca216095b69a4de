"""POST /v1/completions: one or more prompts, `n` samples each, whole or streamed.

Choice `i * n + j` is sample j of prompt i, as in vLLM. With `echo` the prompt is prepended
to each choice's text (and, with `logprobs`, its tokens' logprobs, the first one null).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from tokenmill.entrypoints.http.context import ServerContext, finish_reason
from tokenmill.entrypoints.http.openai.generation_run import (
    ChoiceState,
    Chunk,
    GenerationRun,
    PromptState,
    begin_request,
)
from tokenmill.entrypoints.http.openai.inputs import Prompt
from tokenmill.entrypoints.http.openai.logprobs import (
    completion_logprobs,
    extend_completion_logprobs,
)
from tokenmill.entrypoints.http.openai.params import completion_params
from tokenmill.entrypoints.http.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenmill.sampling_params import SamplingParams


async def create_completion(
    ctx: ServerContext, request: CompletionRequest, raw_request: Request
) -> Response:
    arrival_time = begin_request(ctx, request, "/v1/completions")
    prompts = await ctx.off_loop(
        ctx.prompts.completion_prompts, request.prompt, request.add_special_tokens
    )
    run = CompletionRun(ctx, request, f"cmpl-{uuid.uuid4().hex}", prompts)
    return await run.serve(raw_request, arrival_time)


@dataclass
class _Choice(ChoiceState):
    text_offset: int = 0  # where the next logprob token starts in the returned text
    echoed: bool = False


class CompletionRun(GenerationRun[CompletionRequest]):
    """The state of one completions request while its engine outputs arrive."""

    endpoint = "completion"
    input_param = "prompt"
    choices: list[_Choice]

    def __init__(
        self, ctx: ServerContext, request: CompletionRequest, request_id: str, prompts: list[Prompt]
    ) -> None:
        super().__init__(ctx, request, request_id, prompts)
        self.echo = bool(request.echo)
        # per prompt: outputs held back until the prompt's logprobs arrive (streamed echo)
        self.held: list[list[RequestOutput]] = [[] for _ in prompts]

    def new_choice(self) -> _Choice:
        return _Choice()

    def sampling_params(self, prompt: Prompt) -> SamplingParams:
        max_tokens = self.max_tokens(prompt, self.request.max_tokens, "max_tokens")
        return completion_params(self.request, max_tokens, self.ctx.sampling_defaults)

    # ---- whole ---------------------------------------------------------------------------

    def response(self) -> CompletionResponse:
        choices = [self._whole_choice(i, choice) for i, choice in enumerate(self.choices)]
        response = self._response(choices, self.usage())
        response.kv_transfer_params = self.kv_transfer_params()
        return response

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

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[Chunk]:
        if self._waiting_for_prompt_logprobs(self.prompts[prompt_index]):
            self.held[prompt_index].append(output)
            return []
        ready, self.held[prompt_index] = [*self.held[prompt_index], output], []
        return [self._chunk(prompt_index, c) for o in ready for c in o.outputs]

    def usage_chunk(self) -> CompletionResponse:
        return self._response([], self.usage())

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
        return self._response([delta], self.chunk_usage(index))

    def _waiting_for_prompt_logprobs(self, state: PromptState) -> bool:
        """Streamed echo sends the prompt first, so with logprobs it waits for the prompt's."""
        wanted = self.echo and self.request.logprobs is not None
        return wanted and state.logprobs is None

    # ---- shared --------------------------------------------------------------------------

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

    def _response(
        self, choices: list[CompletionChoice], usage: UsageInfo | None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.ctx.reported_model(self.request.model),
            choices=choices,
            usage=usage,
        )


def _empty_logprobs() -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
