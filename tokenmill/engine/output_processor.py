"""What each step did for each request -> `RequestOutput`s: the text (each sample's
detokenizer, which the output applier feeds as it appends tokens, so that a stop string ends
a request where a stop token would), logprobs, metrics, the `n` samples of a prompt gathered,
shaped as the caller asked (delta, cumulative, final)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.detokenizer import IncrementalDetokenizer, decode_token
from tokenmill.engine.intake import ResolvedRequest, sample_id
from tokenmill.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestError,
    RequestMetrics,
    RequestOutput,
)
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.step.request_step_output import RequestStepOutput
from tokenmill.step.runner_output import PromptLogprobs


@dataclass
class SampleState:
    """One of a prompt's `n` samples."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for delta outputs
    num_preemptions: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # [None, {token: Logprob}, ...] once complete: the first prompt token has no logprob.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False  # delta outputs carry them once, when complete
    changed: set[int] = field(default_factory=set)  # samples with news since the last output
    kv_transfer_params: dict | None = None  # a KV connector's, for the last output
    error: RequestError | None = None  # why a sample ended with finish_reason "error"

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.by_sample_id: dict[str, tuple[RequestState, SampleState]] = {}

    def add_request(self, request: ResolvedRequest) -> list[str]:
        """Registers a request; returns the ids of its samples (`sample_id`)."""
        request_id, params = request.request_id, request.params
        prompt_token_ids = list(request.prompt_token_ids)
        state = RequestState(
            request_id=request_id,
            prompt=request.prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            samples=[],
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )
        sample_ids = request.sample_ids()
        for index, id_ in enumerate(sample_ids):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
            sample = SampleState(index=index, detokenizer=detokenizer)
            if params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = [], 0.0
            state.samples.append(sample)
            self.by_sample_id[id_] = (state, sample)
        self.requests[request_id] = state
        return sample_ids

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the ids of its samples, to abort."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        sample_ids = [sample_id(request_id, s.index, state.params.n) for s in state.samples]
        for id_ in sample_ids:
            self.by_sample_id.pop(id_, None)
        return sample_ids

    def detokenize(self, sample_id: str, token_ids: list[int]) -> str | None:
        """Feed a sample's new tokens to its detokenizer (`OutputApplier.text_stops`): the
        stop string they complete, if any."""
        entry = self.by_sample_id.get(sample_id)
        return None if entry is None else entry[1].detokenizer.update(token_ids)

    def process_outputs(self, step_outputs: list[RequestStepOutput]) -> list[RequestOutput]:
        """The outputs to hand to callers."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        for step_output in step_outputs:
            entry = self.by_sample_id.get(step_output.req_id)
            if entry is None:
                continue
            state, sample = entry
            self._apply(state, sample, step_output, now)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            finished = state.finished
            output = self._make_output(state, finished)
            if output is not None:
                outputs.append(output)
            if finished:
                self.abort_request(state.request_id)
        return outputs

    def _apply(
        self, state: RequestState, sample: SampleState, out: RequestStepOutput, now: float
    ) -> None:
        metrics = state.metrics
        metrics.first_scheduled_time = metrics.first_scheduled_time or out.first_scheduled_time
        if out.new_prompt_logprobs is not None:
            self._append_prompt_logprobs(state, out.new_prompt_logprobs)
        if out.new_token_ids:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
        state.num_cached_tokens = out.num_cached_tokens
        state.kv_transfer_params = out.kv_transfer_params or state.kv_transfer_params
        state.error = out.error or state.error
        if out.num_preemptions > sample.num_preemptions:
            sample.num_preemptions = out.num_preemptions
            metrics.num_preemptions = sum(s.num_preemptions for s in state.samples)
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and sample.logprobs is not None:
            self._append_logprobs(state.params, sample, out)
        if out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if state.finished:
                metrics.finished_time = now
        state.changed.add(sample.index)

    def _append_prompt_logprobs(self, state: RequestState, new: PromptLogprobs) -> None:
        """Positions already known (a sibling sample or a recompute after preemption computed
        them too) are skipped."""
        assert state.prompt_logprobs is not None
        num_top = state.params.prompt_logprobs or 0
        for offset, (token_ids, logprobs, rank) in enumerate(
            zip(new.token_ids, new.logprobs, new.ranks)
        ):
            if new.first_position + offset != len(state.prompt_logprobs):
                continue
            state.prompt_logprobs.append(
                self._position_logprobs(token_ids, logprobs, rank, num_top)
            )

    def _position_logprobs(
        self, token_ids: list[int], logprobs: list[float], rank: int, num_top: int
    ) -> PositionLogprobs:
        """The chosen token's logprob and rank, then the top `num_top` by rank."""
        position: PositionLogprobs = {
            token_ids[0]: Logprob(logprobs[0], rank, decode_token(self.tokenizer, token_ids[0]))
        }
        for top_rank, (token_id, logprob) in enumerate(
            zip(token_ids[1 : num_top + 1], logprobs[1 : num_top + 1]), start=1
        ):
            if token_id not in position:
                position[token_id] = Logprob(
                    logprob, top_rank, decode_token(self.tokenizer, token_id)
                )
        return position

    def _append_logprobs(
        self, params: SamplingParams, sample: SampleState, out: RequestStepOutput
    ) -> None:
        num_top = params.logprobs or 0
        assert out.new_logprob_token_ids is not None and out.new_sampled_token_ranks is not None
        for token_ids, logprobs, rank in zip(
            out.new_logprob_token_ids, out.new_logprobs or [], out.new_sampled_token_ranks
        ):
            sample.logprobs.append(self._position_logprobs(token_ids, logprobs, rank, num_top))
            sample.cumulative_logprob += logprobs[0]

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        indices = sorted(state.changed) if delta else range(len(state.samples))
        state.changed = set()
        completions = [self._completion(state.samples[i], delta) for i in indices]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs_to_send(state, delta),
            error=state.error,
            kv_transfer_params=state.kv_transfer_params if finished else None,
        )

    @staticmethod
    def _prompt_logprobs_to_send(
        state: RequestState, delta: bool
    ) -> list[PositionLogprobs | None] | None:
        logprobs = state.prompt_logprobs
        if logprobs is None or len(logprobs) < len(state.prompt_token_ids):
            return None
        if delta:
            if state.prompt_logprobs_sent:
                return None
            state.prompt_logprobs_sent = True
        return logprobs

    def _completion(self, sample: SampleState, delta: bool) -> CompletionOutput:
        finished = sample.finish_reason is not None
        text = sample.detokenizer.get_next_output_text(finished, delta)
        start = sample.num_sent_tokens if delta else 0
        sample.num_sent_tokens = len(sample.token_ids)
        return CompletionOutput(
            index=sample.index,
            text=text,
            token_ids=sample.token_ids[start:],
            cumulative_logprob=sample.cumulative_logprob,
            logprobs=None if sample.logprobs is None else sample.logprobs[start:],
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )
