"""A step's results applied to the scheduler's requests, and the one place that decides a
request has finished.

After the runner: each scheduled request advances by what was computed (rejected drafts
rolled back), sampled tokens are appended, and a request finishes here on a stop or EOS token
(once `min_tokens` are out), `max_tokens`, the context's end, its grammar's end or dead end,
or a stop string: the tokens go through the request's detokenizer (`TextStops`, the output
processor's) right here, so a stop string ends the request in the same step as a stop token
would. Before the scheduler: requests that cannot run (nothing to generate, a grammar that
failed to compile) finish without computing anything. Finished requests are handed back to
the scheduler to free. The KV connector's transfers that ended are applied here too (loaded
requests may compute, failed loads end). What the scheduler planned is never decided here,
nor the other way round.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.core.sched.stop_check import advance_grammar, check_stop
from tokenmill.step.request import Request, RequestStatus
from tokenmill.step.request_step_output import RequestStepOutput
from tokenmill.step.runner_output import ModelRunnerOutput
from tokenmill.step.scheduler_output import SchedulerOutput
from tokenmill.structured_output.request_grammar import UNSATISFIABLE

# (request id, its new tokens as text should show them) -> the stop string they complete.
TextStops = Callable[[str, list[int]], str | None]


class OutputApplier:
    def __init__(self, scheduler: Scheduler, text_stops: TextStops | None = None) -> None:
        self.scheduler = scheduler
        self.observer = scheduler.observer
        self.text_stops = text_stops

    def finish_unrunnable(self) -> list[RequestStepOutput]:
        """Requests that must end before computing anything: `max_tokens == 0` without
        prompt logprobs (with them, the prompt is computed and nothing sampled), and those
        whose grammar failed to compile (finish_reason "error", the reason in stop_reason)."""
        waiting = self.scheduler.waiting
        done = [
            r
            for r in waiting
            if r.max_tokens <= r.num_output_tokens and r.sampling_params.prompt_logprobs is None
        ]
        failed = [
            r for r in waiting if r.grammar is not None and r.grammar.is_ready() and r.grammar.error
        ]
        if not done and not failed:
            return []
        finish = self.scheduler.finish_requests
        finish([r.sample_id for r in done], RequestStatus.FINISHED_LENGTH_CAPPED)
        finish([r.sample_id for r in failed], RequestStatus.FINISHED_ERROR)
        return [RequestStepOutput(r.sample_id, [], finish_reason="length") for r in done] + [
            RequestStepOutput(r.sample_id, [], finish_reason="error", stop_reason=r.grammar.error)
            for r in failed
            if r.grammar is not None
        ]

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestStepOutput]:
        """Advance each scheduled request by what was computed and append sampled tokens."""
        requests = self.scheduler.requests
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is not None:
                self._count_prefill(request, num_tokens)
                request.num_computed_tokens += num_tokens

        outputs: list[RequestStepOutput] = []
        finished_ids: list[str] = []
        prompt_logprobs = dict(runner_output.prompt_logprobs or {})
        for row, req_id in enumerate(runner_output.req_ids):
            request = requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            drafts = scheduler_output.scheduled_spec_tokens.get(req_id, [])
            output = self._append_sampled(request, runner_output, row, drafts)
            output.new_prompt_logprobs = prompt_logprobs.pop(req_id, None)
            outputs.append(output)
            if request.is_finished:
                finished_ids.append(req_id)
        for req_id, logprobs in prompt_logprobs.items():  # prompt chunks that sampled nothing
            if req_id in requests:
                outputs.append(RequestStepOutput(req_id, [], new_prompt_logprobs=logprobs))
        # The step has written its KV (rejected drafts rolled back above): only now may other
        # requests find these blocks in the prefix cache.
        for req_id in scheduler_output.num_scheduled_tokens:
            if (request := requests.get(req_id)) is not None:
                self.scheduler.kv_cache_manager.cache_computed_blocks(request)
        params = self.scheduler.free_finished(finished_ids)
        for output in outputs:  # the KV connector's news for another engine
            output.kv_transfer_params = params.get(output.req_id)
        return outputs + self._kv_transfers_ended(runner_output)

    def _kv_transfers_ended(self, runner_output: ModelRunnerOutput) -> list[RequestStepOutput]:
        """The KV connector's loads and sends that ended: arrived KV lets its request
        compute, held blocks are freed, and requests whose load failed may end here."""
        remote_kv = self.scheduler.remote_kv
        if remote_kv is None or runner_output.kv_connector_output is None:
            return []
        ended = remote_kv.update(runner_output.kv_connector_output)
        self.scheduler.free_finished([output.req_id for output in ended])
        return ended

    def _count_prefill(self, request: Request, num_new_computed: int) -> None:
        """Count a prompt once, in the step that completes its first prefill (a prefill
        redone after preemption, with output tokens already sampled, does not count)."""
        computed = request.num_computed_tokens
        end = request.num_prompt_tokens
        if computed < end <= computed + num_new_computed and not request.output_token_ids:
            self.observer.prefilled(end, max(request.num_cached_tokens, 0))

    def _append_sampled(
        self,
        request: Request,
        runner_output: ModelRunnerOutput,
        row: int,
        drafts: list[int],
    ) -> RequestStepOutput:
        generated = runner_output.sampled_token_ids[row]
        if drafts:
            # Roll back the rejected drafts: their KV slots will be overwritten.
            num_accepted = len(generated) - 1
            request.num_computed_tokens -= len(drafts) - num_accepted
            self.observer.verified(len(drafts), num_accepted)
        if request.max_tokens == 0:  # computed only for its prompt logprobs
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        grammar = request.grammar
        dead_row = None if grammar is None else grammar.dead_row
        if dead_row is not None and len(generated) > dead_row:
            # The step sampled at a row no token can continue (its tokens, kept, led there).
            generated = generated[:dead_row]
        else:
            dead_row = None
        new_token_ids = self._append_tokens(request, generated)
        if grammar is not None:
            grammar.dead_row = None
        if dead_row is not None and not request.is_finished:
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = UNSATISFIABLE
        self._check_stop_strings(request, new_token_ids)
        spec = (runner_output.spec_token_ids or {}).get(request.sample_id, [])
        if grammar is not None and spec and not request.is_finished:
            spec = grammar.valid_prefix(spec)  # drafts the grammar rejects are not verified
        request.spec_token_ids = spec
        output = RequestStepOutput(
            req_id=request.sample_id,
            new_token_ids=new_token_ids,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time,
            num_preemptions=request.num_preemptions,
        )
        if runner_output.logprobs is not None and new_token_ids:
            assert runner_output.logprob_token_ids and runner_output.sampled_token_ranks
            count = len(new_token_ids)
            output.new_logprob_token_ids = runner_output.logprob_token_ids[row][:count]
            output.new_logprobs = runner_output.logprobs[row][:count]
            output.new_sampled_token_ranks = runner_output.sampled_token_ranks[row][:count]
        return output

    def _append_tokens(self, request: Request, generated: list[int]) -> list[int]:
        """Append tokens up to the first that ends the request (those after it are dropped)."""
        new_token_ids: list[int] = []
        for token_id in generated if not request.is_finished else []:
            request.append_output_token(token_id)
            new_token_ids.append(token_id)
            check_stop(request, token_id, self.scheduler.max_model_len)
            if request.grammar is not None and not request.is_finished:
                advance_grammar(request, token_id)
            if request.is_finished:
                break
        return new_token_ids

    def _check_stop_strings(self, request: Request, new_token_ids: list[int]) -> None:
        """Detokenize the new tokens; a stop string they complete ends the request and is its
        stop reason (also where a token ended it in the same step). The EOS or stop token
        that ended a request is not part of its text (as in vLLM), unless the caller asked
        for stop strings in the output."""
        if self.text_stops is None or not new_token_ids:
            return
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED and not isinstance(
            request.stop_reason, str
        )
        text_ids = new_token_ids
        if stopped_by_token and not request.sampling_params.include_stop_str_in_output:
            text_ids = new_token_ids[:-1]
        stop_string = self.text_stops(request.sample_id, text_ids)
        if stop_string is not None:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_string
