"""The token-budget scheduler: one decision per engine step, no prefill or decode phases.

Each step hands out `max_num_batched_tokens`: running requests first (in admission order),
then waiting ones. A request is given `num_tokens - num_computed_tokens` tokens, cut to what
is left of the budget, so a long prompt is simply computed over several steps (chunked
prefill) while the decodes of others share each forward pass. A prefix-cache hit starts
`num_computed_tokens` above zero; preemption by recompute sets it back to zero.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.config import PREEMPTION_MODES
from tokenmill.core.draft_length_policy import SpeculationPolicy
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.prefill_budget import PrefillBudget, PrefillLimits
from tokenmill.core.remote_kv import RemoteKVRequests
from tokenmill.core.request_queue import RequestQueue
from tokenmill.core.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenmill.core.step_cost import StepShape, chunk_context
from tokenmill.core.step_feedback import ItlFeedback, SpeculationFeedback
from tokenmill.core.stop_check import advance_grammar, check_stop
from tokenmill.kv_transfer.base import KVConnectorBase
from tokenmill.metrics.stats import PrefixCacheStats, SchedulerStats, SpecDecodeStats
from tokenmill.request import Request, RequestStatus
from tokenmill.structured_output.request_grammar import UNSATISFIABLE

# Cache-aware admission looks this far down the waiting queue for the request with the most
# prompt tokens already in the prefix cache...
CACHE_AWARE_WINDOW = 8
# ...but the request at the head is passed over at most this many times, so the oldest request
# waits for no more than this many extra admissions (a few steps) and never starves.
MAX_HEAD_SKIPS = 4


@dataclass
class _StepPlan:
    """What one `schedule()` call has decided so far."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: dict[str, CachedRequestData] = field(default_factory=dict)
    preempted_ids: set[str] = field(default_factory=set)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_to_propose: int = 0  # drafts per request to propose for the next step
    lookahead: int = 0  # slots past the scheduled tokens the draft model will write
    prefill: PrefillBudget | None = None  # limits on prompt tokens beyond `budget`, if any


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
        preemption_mode: str = "recompute",
        spec_policy: SpeculationPolicy | None = None,
        spec_lookahead: bool = False,
        prefill_limits: PrefillLimits | None = None,
        kv_connector: KVConnectorBase | None = None,
    ) -> None:
        """`policy` and `preemption_mode` are among `EngineConfig`'s choices (validated there):
        `SCHEDULING_POLICIES` and `PREEMPTION_MODES` in config.py say what each does."""
        self.policy = policy
        self.preemption_mode = preemption_mode
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue(by_priority=policy == "priority")
        self.running: list[Request] = []  # in admission order
        self.finished_req_ids: set[str] = set()  # to tell the runner at the next step
        self.num_preemptions_by_mode = dict.fromkeys(PREEMPTION_MODES, 0)
        self.num_prompt_tokens_scheduled = 0  # since start; output recomputed after preemption
        self.last_num_scheduled_tokens = 0  # is not counted as prompt
        # Whole prompts, each counted once when its prefill completes (as vLLM counts them),
        # and how many of those tokens came from the prefix cache.
        self.num_prompt_tokens_prefilled = 0
        self.num_cached_prompt_tokens_prefilled = 0
        # Speculative decoding: the policy picking k, whether proposals need KV slots of their
        # own (a draft model writes its cache ahead), and what the last step did for the policy.
        self.spec_policy = spec_policy
        self.spec_lookahead = spec_lookahead
        self.spec_stats = SpecDecodeStats() if spec_policy else None
        self.spec_feedback = SpeculationFeedback()
        # Prefill limits (ITL target, per-request threshold, partial prefills); with a target,
        # the last step's shape waits for its measured time to feed the cost model.
        self.prefill_limits = prefill_limits or PrefillLimits()
        self.itl_feedback = ItlFeedback.for_limits(self.prefill_limits)
        # The scheduler half of a KV connector: KV loaded from outside, saved after steps;
        # the requests whose KV it moves asynchronously (loading, or finished and held).
        self.kv_connector = kv_connector
        self.remote_kv = (
            None
            if kv_connector is None
            else RemoteKVRequests(kv_connector, kv_cache_manager, self.waiting)
        )

    @property
    def num_preemptions(self) -> int:
        return sum(self.num_preemptions_by_mode.values())

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        if request.request_id in self.requests or (
            self.remote_kv is not None and request.request_id in self.remote_kv
        ):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.kv_cache_manager.enable_caching:
            # Hash the prompt now: data that cannot be hashed fails this call alone, not a
            # later step that every running request is part of.
            self.kv_cache_manager.block_hashes(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string): free their blocks now."""
        assert status.is_finished
        ids = {rid for rid in request_ids if rid in self.requests}
        if not ids:
            return
        self.running = [r for r in self.running if r.request_id not in ids]
        self.waiting.remove_ids(ids)
        if self.remote_kv is not None:
            for rid in ids:
                self.remote_kv.finish(rid)
        for rid in ids:
            request = self.requests.pop(rid)
            request.status = status
            self._free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_kv_transfers(self) -> bool:
        """KV the connector still moves (loads on their way, finished requests' blocks held
        for a send): the engine keeps stepping for it even with nothing to run."""
        return self.remote_kv is not None and self.remote_kv.has_pending

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    def set_itl_target(self, seconds: float) -> None:
        """Move the ITL target of an engine started with one (its cost model is calibrated)."""
        if self.itl_feedback is None:
            raise ValueError("the engine was started without an ITL target (itl_target_ms)")
        if not seconds > 0:
            raise ValueError(f"an ITL target must be positive, got {seconds} s")
        self.prefill_limits.itl_target = seconds  # the feedback and its stats read it there

    # ---- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        if self.spec_policy is not None:
            # Requests that will decode this step (one token left to compute), as observed.
            num_decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
            plan.num_to_propose = self.spec_policy.choose(num_decoding)
            plan.lookahead = plan.num_to_propose if self.spec_lookahead else 0
        admitting = self._may_admit()
        if self.prefill_limits.active:
            plan.prefill = PrefillBudget(self.prefill_limits, self._num_decode_tokens_running())
        self._schedule_running(plan)
        # Admit waiting requests only when nothing was preempted: a preemption means memory is
        # short, and admitting would just preempt again next step.
        if admitting and not plan.preempted_ids:
            self._schedule_waiting(plan)

        assert plan.budget >= 0 and len(self.running) <= self.max_num_seqs
        total = self.max_num_batched_tokens - plan.budget
        assert total == sum(plan.num_scheduled.values())
        self.last_num_scheduled_tokens = total
        self.num_prompt_tokens_scheduled += self._num_prompt_tokens(plan.num_scheduled)
        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=list(plan.cached_reqs.values()),
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=plan.preempted_ids,
            blocks_to_swap_out=plan.swap_out,
            blocks_to_swap_in=plan.swap_in,
            scheduled_spec_tokens=plan.spec_tokens,
            num_spec_tokens_to_propose=plan.num_to_propose,
        )
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(
                output, self.requests, self.kv_cache_manager.get_block_ids
            )
        self.finished_req_ids = set()
        if self.spec_policy is not None:
            self.spec_feedback.planned(output, plan.cached_reqs.keys())
        if self.itl_feedback is not None and total:
            self.itl_feedback.planned(self._step_shape(plan), plan.prefill)
        return output

    def _num_decode_tokens_running(self) -> int:
        """Tokens the running decodes will compute this step, drafts included (at most)."""
        return sum(
            1 + len(r.spec_token_ids)
            for r in self.running
            if r.num_tokens - r.num_computed_tokens == 1
        )

    def _step_shape(self, plan: _StepPlan) -> StepShape:
        """What the cost model sees of the step just planned."""
        num_decode = num_prefill = num_context = 0
        for req_id, num_new in plan.num_scheduled.items():
            request = self.requests[req_id]
            num_cached = request.num_computed_tokens
            # A decode: running, one token left (drafts are not in num_tokens).
            if req_id in plan.cached_reqs and request.num_tokens - num_cached == 1:
                num_decode += num_new
            else:
                num_prefill += num_new
                num_context += chunk_context(num_new, num_cached)
        return StepShape(num_decode, num_prefill, num_context)

    def observe_step_cost(self, seconds: float) -> None:
        """The whole last step took `seconds` (what every decoding request waited for its
        token): the ITL target's cost model learns from it."""
        if self.itl_feedback is not None:
            self.itl_feedback.observe(seconds)

    def observe_step_time(self, seconds: float, output: ModelRunnerOutput) -> None:
        """Feed the speculation policy what the last step's decodes cost and yielded."""
        if self.spec_policy is not None:
            sample = self.spec_feedback.measure(seconds, output)
            if sample is not None:
                self.spec_policy.observe(*sample)

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            num_left = request.num_tokens - request.num_computed_tokens
            assert num_left > 0, f"running {request} has nothing to compute"
            is_prompt = num_left > 1
            num_new = self._num_new_tokens(num_left, request.num_computed_tokens, plan, is_prompt)
            if num_new == 0:  # a prompt the prefill limits hold back this step
                index += 1
                continue
            drafts = self._drafts_to_verify(request, num_new, plan)
            num_new += len(drafts)
            while (
                new_block_ids := self.kv_cache_manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=self._lookahead(request, num_new, plan)
                )
            ) is None:
                victim = self._pick_victim()
                if victim.request_id in plan.num_scheduled:  # already given tokens: take back
                    plan.budget += plan.num_scheduled.pop(victim.request_id)
                    del plan.cached_reqs[victim.request_id]
                    plan.spec_tokens.pop(victim.request_id, None)
                    index -= 1
                self.running.remove(victim)
                self._preempt(victim, plan)
                if victim is request:
                    break
            if new_block_ids is None:
                continue  # the request preempted itself; `index` now points past it
            plan.cached_reqs[request.request_id] = CachedRequestData(
                request.request_id, new_block_ids, request.num_computed_tokens
            )
            if drafts:
                plan.spec_tokens[request.request_id] = drafts
            if is_prompt:
                self._book_prefill(plan, num_new, num_left, request.num_computed_tokens)
            plan.num_scheduled[request.request_id] = num_new
            plan.budget -= num_new
            index += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        manager = self.kv_cache_manager
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._pick_waiting()
            if request is None:  # every waiting request's grammar is still compiling
                break
            if manager.is_swapped(request):
                num_cached = request.num_computed_tokens
                num_left = request.num_tokens - num_cached
                num_new = self._num_new_tokens(num_left, num_cached, plan, is_prompt=True)
                if num_new == 0:
                    break
                pairs = manager.swap_in(request, num_new)
                if pairs is None:
                    break
                plan.swap_in.extend(pairs)
            elif manager.holds_blocks(request):  # its KV arrived through the connector
                num_cached = request.num_computed_tokens
                num_left = request.num_tokens - num_cached
                num_new = self._num_new_tokens(num_left, num_cached, plan, is_prompt=True)
                lookahead = self._lookahead(request, num_new, plan)
                if num_new == 0 or manager.allocate_slots(request, num_new, (), lookahead) is None:
                    break
            else:
                hits, num_hit = manager.get_computed_blocks(request)
                num_external, load_async = self._num_external_tokens(request, num_hit)
                if load_async:
                    if manager.allocate_slots(request, num_external, hits) is None:
                        break
                    manager.record_prefix_lookup(request, num_hit)
                    assert self.remote_kv is not None
                    self.remote_kv.admit(request, num_hit, num_external)
                    continue
                num_cached = num_hit + num_external
                num_left = request.num_tokens - num_cached
                if num_left > plan.budget and not self.enable_chunked_prefill:
                    break
                num_new = self._num_new_tokens(num_left, num_cached, plan, is_prompt=True)
                if num_new == 0:
                    break
                lookahead = self._lookahead(request, num_new, plan, num_cached)
                if manager.allocate_slots(request, num_new + num_external, hits, lookahead) is None:
                    break
                manager.record_prefix_lookup(request, num_hit)
                if self.kv_connector is not None:
                    self.kv_connector.update_state_after_alloc(
                        request, manager.get_block_ids(request.request_id), num_external
                    )
                request.num_computed_tokens = num_cached
            self.waiting.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
            plan.new_reqs.append(self._new_request_data(request))
            self._book_prefill(plan, num_new, num_left, num_cached)
            plan.num_scheduled[request.request_id] = num_new
            plan.budget -= num_new

    def _num_external_tokens(self, request: Request, num_hit: int) -> tuple[int, bool]:
        """Tokens past the local prefix-cache hit whose KV the connector will load, and
        whether they arrive asynchronously (the request waits off the step for them)."""
        if self.kv_connector is None:
            return 0, False
        return self.kv_connector.get_num_new_matched_tokens(request, num_hit)

    @staticmethod
    def _num_new_tokens(num_left: int, num_cached: int, plan: _StepPlan, is_prompt: bool) -> int:
        """Tokens a request with `num_left` to compute gets this step: all that fit the token
        budget, and for a prompt what the prefill limits allow. A prompt is what a waiting
        request computes, or a running one with more than one token left; the rest are
        decodes, charged to the prefill budget when the step began."""
        if plan.prefill is None or not is_prompt:
            return min(num_left, plan.budget)
        return plan.prefill.grant(num_left, num_cached, plan.budget)

    @staticmethod
    def _book_prefill(plan: _StepPlan, num_new: int, num_left: int, num_cached: int) -> None:
        if plan.prefill is not None:
            plan.prefill.take(num_new, num_left, num_cached)

    def _drafts_to_verify(self, request: Request, num_new: int, plan: _StepPlan) -> list[int]:
        """The request's drafts that fit this step: only for a plain decode (one token left to
        compute), within the budget, `max_model_len` and `max_tokens` (the step emits up to
        one token more than it verifies)."""
        if not request.spec_token_ids or num_new != 1:
            return []
        limit = min(
            plan.budget - 1,
            self.max_model_len - request.num_tokens - 1,
            request.max_tokens - request.num_output_tokens - 1,
        )
        return request.spec_token_ids[: max(limit, 0)]

    def _lookahead(
        self, request: Request, num_new: int, plan: _StepPlan, num_computed: int | None = None
    ) -> int:
        """Slots past this step's tokens that the draft model will fill while proposing."""
        computed = request.num_computed_tokens if num_computed is None else num_computed
        return max(0, min(plan.lookahead, self.max_model_len - computed - num_new))

    def _pick_waiting(self) -> Request | None:
        """The next request to admit: the head of the queue, unless one of the next few (of
        the same priority) has more of its prompt in the prefix cache. Serving it now, while
        its prefix is cached, saves recomputing that prefix after an eviction. Requests whose
        grammar is still compiling are passed over (they keep their place)."""
        head = next((r for r in self.waiting if _grammar_ready(r)), None)
        manager = self.kv_cache_manager
        if (
            head is None
            or not manager.enable_caching
            or head.num_skips >= MAX_HEAD_SKIPS
            or len(self.waiting) < 2
        ):
            return head
        best, best_hits = head, -1
        for candidate in self.waiting.head(CACHE_AWARE_WINDOW):
            if (
                candidate.priority != head.priority
                or manager.is_swapped(candidate)
                or not _grammar_ready(candidate)
            ):
                continue
            num_hits = manager.get_computed_blocks(candidate)[1]
            if num_hits > best_hits:
                best, best_hits = candidate, num_hits
        if best is not head:
            head.num_skips += 1
        return best

    def _pick_victim(self) -> Request:
        """FCFS preempts the most recently admitted request; priority the lowest-priority one
        (largest value), the most recently arrived among equals."""
        if self.policy != "priority":
            return self.running[-1]
        return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))

    def _num_prompt_tokens(self, num_scheduled: dict[str, int]) -> int:
        total = 0
        for req_id, num_new in num_scheduled.items():
            request = self.requests[req_id]
            prompt_end = min(request.num_prompt_tokens, request.num_computed_tokens + num_new)
            total += max(0, prompt_end - request.num_computed_tokens)
        return total

    def _count_prefill(self, request: Request, num_new_computed: int) -> None:
        """Count a prompt once, in the step that completes its first prefill (a prefill
        redone after preemption, with output tokens already sampled, does not count)."""
        computed = request.num_computed_tokens
        end = request.num_prompt_tokens
        if computed < end <= computed + num_new_computed and not request.output_token_ids:
            self.num_prompt_tokens_prefilled += end
            self.num_cached_prompt_tokens_prefilled += max(request.num_cached_tokens, 0)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request by what was computed and append sampled tokens."""
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                self._count_prefill(request, num_tokens)
                request.num_computed_tokens += num_tokens

        outputs: list[EngineCoreOutput] = []
        finished_ids: set[str] = set()
        prompt_logprobs = dict(runner_output.prompt_logprobs or {})
        for row, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            drafts = scheduler_output.scheduled_spec_tokens.get(req_id, [])
            output = self._append_sampled(request, runner_output, row, drafts)
            output.new_prompt_logprobs = prompt_logprobs.pop(req_id, None)
            outputs.append(output)
            if request.is_finished:
                finished_ids.add(req_id)
        for req_id, logprobs in prompt_logprobs.items():  # prompt chunks that sampled nothing
            if req_id in self.requests:
                outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=logprobs))
        # The step has written its KV (rejected drafts rolled back above): only now may other
        # requests find these blocks in the prefix cache.
        for req_id in scheduler_output.num_scheduled_tokens:
            if (request := self.requests.get(req_id)) is not None:
                self.kv_cache_manager.cache_computed_blocks(request)

        if finished_ids:
            self.running = [r for r in self.running if r.request_id not in finished_ids]
            for output in outputs:
                if output.req_id in finished_ids:
                    output.kv_transfer_params = self._free(self.requests.pop(output.req_id))
        if self.remote_kv is not None and runner_output.kv_connector_output is not None:
            ended = self.remote_kv.update(runner_output.kv_connector_output)
            for output in ended:
                self._free(self.requests.pop(output.req_id))
            outputs += ended
        return outputs

    def finish_without_output(self) -> list[EngineCoreOutput]:
        """Requests that must end before computing anything: `max_tokens == 0` without
        prompt logprobs (with them, the prompt is computed and nothing sampled), and those
        whose grammar failed to compile (finish_reason "error", the reason in stop_reason)."""
        done = [
            r
            for r in self.waiting
            if r.max_tokens <= r.num_output_tokens and r.sampling_params.prompt_logprobs is None
        ]
        failed = [
            r
            for r in self.waiting
            if r.grammar is not None and r.grammar.is_ready() and r.grammar.error
        ]
        if not done and not failed:
            return []
        self.finish_requests([r.request_id for r in done], RequestStatus.FINISHED_LENGTH_CAPPED)
        self.finish_requests([r.request_id for r in failed], RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(r.request_id, [], finish_reason="length") for r in done] + [
            EngineCoreOutput(r.request_id, [], finish_reason="error", stop_reason=r.grammar.error)
            for r in failed
            if r.grammar is not None
        ]

    def get_stats(self) -> SchedulerStats:
        manager = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_scheduled_tokens=self.last_num_scheduled_tokens,
            num_preemptions=self.num_preemptions,
            num_kv_blocks_used=manager.num_blocks - manager.num_free_blocks,
            num_kv_blocks=manager.num_blocks,
            num_preemptions_by_mode=dict(self.num_preemptions_by_mode),
            prefix_cache=PrefixCacheStats(
                manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits
            ),
            spec_decode=None if self.spec_stats is None else copy.deepcopy(self.spec_stats),
            itl_target=None
            if self.itl_feedback is None
            else replace(
                copy.deepcopy(self.itl_feedback.stats), itl_target=self.prefill_limits.itl_target
            ),
        )

    # ---- internals ---------------------------------------------------------------------------

    def _may_admit(self) -> bool:
        """Under the static policy a batch is what one step admits (up to max_num_seqs and the
        token budget); nobody joins until every member has finished."""
        return self.policy != "static" or not self.running

    def _append_sampled(
        self,
        request: Request,
        runner_output: ModelRunnerOutput,
        row: int,
        drafts: list[int],
    ) -> EngineCoreOutput:
        generated = runner_output.sampled_token_ids[row]
        if drafts:
            # Roll back the rejected drafts: their KV slots will be overwritten.
            num_accepted = len(generated) - 1
            request.num_computed_tokens -= len(drafts) - num_accepted
            assert self.spec_stats is not None
            self.spec_stats.record(len(drafts), num_accepted)
        new_token_ids = []
        if request.max_tokens == 0:  # computed only for its prompt logprobs
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        grammar = request.grammar
        dead_row = None if grammar is None else grammar.dead_row
        if dead_row is not None and len(generated) > dead_row:
            # The step sampled at a row no token can continue (its tokens, kept, led there).
            generated = generated[:dead_row]
        else:
            dead_row = None
        for token_id in generated if not request.is_finished else []:
            request.append_output_token(token_id)
            new_token_ids.append(token_id)
            check_stop(request, token_id, self.max_model_len)
            if grammar is not None and not request.is_finished:
                advance_grammar(request, token_id)
            if request.is_finished:  # tokens after a stop are dropped
                break
        if grammar is not None:
            grammar.dead_row = None
        if dead_row is not None and not request.is_finished:
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = UNSATISFIABLE
        spec = (runner_output.spec_token_ids or {}).get(request.request_id, [])
        if grammar is not None and spec and not request.is_finished:
            spec = grammar.valid_prefix(spec)  # drafts the grammar rejects are not verified
        request.spec_token_ids = spec
        output = EngineCoreOutput(
            req_id=request.request_id,
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

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Swap: copy the request's blocks to the host pool and keep its progress. Recompute
        (also the fallback when the host pool is full): give back every block and start over;
        the tokens generated so far are kept and recomputed as if they were prompt (prefix
        caching usually finds most of them still cached). Either way it waits at its place."""
        pairs = None
        if self.preemption_mode == "swap":
            pairs = self.kv_cache_manager.swap_out(request)
        if pairs is None:
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            self.num_preemptions_by_mode["recompute"] += 1
        else:
            plan.swap_out.extend(pairs)
            self.num_preemptions_by_mode["swap"] += 1
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.num_preemptions += 1
        plan.preempted_ids.add(request.request_id)
        self.waiting.add_preempted(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
        )

    def _free(self, request: Request) -> dict[str, Any] | None:
        """Give a finished request's blocks back, unless the KV connector still moves them
        (then they are freed when it reports that transfer ended); returns the connector's
        `kv_transfer_params` for the request's last output."""
        held, params = False, None
        if self.kv_connector is not None and self.remote_kv is not None:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            held, params = self.kv_connector.request_finished(request, block_ids)
        if held and self.remote_kv is not None:
            self.remote_kv.hold(request)
        else:
            self.kv_cache_manager.free(request)
        self.waiting.forget(request)
        self.finished_req_ids.add(request.request_id)
        if request.grammar is not None:
            request.grammar.release()  # a compile nobody waits for is cancelled
        return params


def _grammar_ready(request: Request) -> bool:
    """May be admitted: no grammar, or one compiled (a failed one is finished instead)."""
    grammar = request.grammar
    return grammar is None or (grammar.is_ready() and grammar.error is None)
