"""The token-budget scheduler: one decision per engine step, no prefill or decode phases.

Each step hands out `max_num_batched_tokens`: running requests first (in admission order),
then waiting ones (FCFS). A request is given `num_tokens - num_computed_tokens` tokens, cut to
what is left of the budget, so a long prompt is simply computed over several steps (chunked
prefill) while the decodes of others share each forward pass.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenmill.request import Request, RequestStatus

# "static" is the baseline continuous batching is measured against: a batch is formed from the
# waiting queue and runs until every member finishes before anyone else is admitted.
SCHEDULING_POLICIES = ("fcfs", "static")


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int  # in the last step
    num_preemptions: int  # since start
    num_kv_blocks_used: int
    num_kv_blocks: int

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}: {policy!r}")
        self.policy = policy
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.finished_req_ids: set[str] = set()  # to tell the runner at the next step
        self.num_preemptions = 0
        self.num_prompt_tokens_scheduled = 0  # since start; output recomputed after preemption
        self.last_num_scheduled_tokens = 0  # is not counted as prompt

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string): free their blocks now."""
        assert status.is_finished
        ids = {rid for rid in request_ids if rid in self.requests}
        if not ids:
            return
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        for rid in ids:
            request = self.requests.pop(rid)
            request.status = status
            self._free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted_ids: set[str] = set()

        admitting = self._may_admit()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running {request} has nothing to compute"
            new_block_ids = self._allocate_or_preempt(request, num_new, preempted_ids)
            if new_block_ids is None:
                break  # the request preempted itself: nothing later in `running` can run
            cached_reqs.append(
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
            )
            self._record(request, num_new, num_scheduled)
            budget -= num_new
            index += 1

        # Admit waiting requests only when nothing was preempted: a preemption means memory is
        # short, and admitting would just preempt again next step.
        admitting = admitting and not preempted_ids
        while admitting and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget and not self.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv_cache_manager.allocate_slots(request, num_new) is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            new_reqs.append(self._new_request_data(request))
            self._record(request, num_new, num_scheduled)
            budget -= num_new

        assert budget >= 0 and len(self.running) <= self.max_num_seqs
        total = self.max_num_batched_tokens - budget
        self.last_num_scheduled_tokens = total
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_ids,
        )
        self.finished_req_ids = set()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request by what was computed and append sampled tokens."""
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                request.num_computed_tokens += num_tokens

        outputs: list[EngineCoreOutput] = []
        finished_ids: set[str] = set()
        prompt_logprobs = dict(runner_output.prompt_logprobs or {})
        for row, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            output = self._append_sampled(request, runner_output, row)
            output.new_prompt_logprobs = prompt_logprobs.pop(req_id, None)
            outputs.append(output)
            if request.is_finished:
                finished_ids.add(req_id)
        for req_id, logprobs in prompt_logprobs.items():  # prompt chunks that sampled nothing
            if req_id in self.requests:
                outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=logprobs))

        if finished_ids:
            self.running = [r for r in self.running if r.request_id not in finished_ids]
            for req_id in finished_ids:
                self._free(self.requests.pop(req_id))
        return outputs

    def finish_without_output(self) -> list[EngineCoreOutput]:
        """Requests that must end before computing anything: `max_tokens == 0` without
        prompt logprobs (with them, the prompt is computed and nothing sampled)."""
        done = [
            r
            for r in self.waiting
            if r.max_tokens <= r.num_output_tokens and r.sampling_params.prompt_logprobs is None
        ]
        if not done:
            return []
        self.finish_requests([r.request_id for r in done], RequestStatus.FINISHED_LENGTH_CAPPED)
        return [EngineCoreOutput(r.request_id, [], finish_reason="length") for r in done]

    def get_stats(self) -> SchedulerStats:
        manager = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_scheduled_tokens=self.last_num_scheduled_tokens,
            num_preemptions=self.num_preemptions,
            num_kv_blocks_used=manager.num_blocks - manager.num_free_blocks,
            num_kv_blocks=manager.num_blocks,
        )

    # ---- internals ---------------------------------------------------------------------------

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted_ids: set[str]
    ) -> list[int] | None:
        """Allocate slots for a running request, preempting the most recently admitted
        requests until it fits. None if the request itself had to be preempted."""
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            preempted_ids.add(victim.request_id)
            if victim is request:
                return None

    def _may_admit(self) -> bool:
        """Under the static policy a batch is what one step admits (up to max_num_seqs and the
        token budget); nobody joins until every member has finished."""
        return self.policy != "static" or not self.running

    def _record(self, request: Request, num_new: int, num_scheduled: dict[str, int]) -> None:
        num_scheduled[request.request_id] = num_new
        prompt_end = min(request.num_prompt_tokens, request.num_computed_tokens + num_new)
        self.num_prompt_tokens_scheduled += max(0, prompt_end - request.num_computed_tokens)

    def _append_sampled(
        self, request: Request, runner_output: ModelRunnerOutput, row: int
    ) -> EngineCoreOutput:
        new_token_ids = []
        if request.max_tokens == 0:  # computed only for its prompt logprobs
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        else:
            token_id = runner_output.sampled_token_ids[row]
            request.append_output_token(token_id)
            new_token_ids.append(token_id)
            self._check_stop(request, token_id)
        output = EngineCoreOutput(
            req_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time,
        )
        if runner_output.logprobs is not None and new_token_ids:
            assert runner_output.logprob_token_ids and runner_output.sampled_token_ranks
            output.new_logprob_token_ids = [runner_output.logprob_token_ids[row]]
            output.new_logprobs = [runner_output.logprobs[row]]
            output.new_sampled_token_ranks = [runner_output.sampled_token_ranks[row]]
        return output

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: give back every block and start over from the front of the
        queue. The tokens generated so far are kept and recomputed as if they were prompt."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
        )

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)

    def _check_stop(self, request: Request, token_id: int) -> None:
        """Finish the request if this token ends it: a stop or EOS token (once `min_tokens`
        are out), `max_tokens`, or `max_model_len`."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return
            if not params.ignore_eos and token_id in params.all_stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
        if request.num_output_tokens >= request.max_tokens or (
            request.num_tokens >= self.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
