"""The token-budget scheduler: one decision per engine step, no prefill or decode phases.

Each step hands out `max_num_batched_tokens`: running requests first (in admission order),
then waiting ones. A request is given `num_tokens - num_computed_tokens` tokens, cut to the
budget left, so a long prompt is computed over several steps (chunked prefill) beside others'
decodes. A prefix-cache hit starts `num_computed_tokens` above zero; recompute resets it.

The scheduler only plans: a step's results are applied to its requests, and finished ones
decided, by the output applier (`output_applier.py`); what is learned from a step once it is
measured goes to its observer (`core/feedback/observer.py`), which it tells of each plan.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.config import PREEMPTION_MODES
from tokenmill.core.feedback.observer import StepObserver
from tokenmill.core.feedback.prefill_budget import PrefillBudget, PrefillLimits
from tokenmill.core.feedback.speculation_policy import SpeculationPolicy
from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.sched.remote_kv import RemoteKVRequests
from tokenmill.core.sched.request_queue import RequestQueue
from tokenmill.kv_transfer.base import KVConnectorBase
from tokenmill.metrics.stats import PrefixCacheStats, SchedulerStats
from tokenmill.step.request import Request, RequestStatus
from tokenmill.step.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.structured_output.request_grammar import RequestGrammar


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
        observer: StepObserver | None = None,
    ) -> None:
        """`policy` and `preemption_mode` are among `EngineConfig`'s choices (validated there):
        `SCHEDULING_POLICIES` and `PREEMPTION_MODES` in config.py say what each does.
        `observer` hears of every plan (default: one over `spec_policy` and
        `prefill_limits`)."""
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
        # Speculative decoding: the policy picking k, and whether proposals need KV slots of
        # their own (a draft model writes its cache ahead).
        self.spec_policy = spec_policy
        self.spec_lookahead = spec_lookahead
        # Prefill limits (ITL target, per-request threshold, partial prefills).
        self.prefill_limits = prefill_limits or PrefillLimits()
        # The scheduler half of a KV connector: KV loaded from outside, saved after steps;
        # the requests whose KV it moves asynchronously (loading, or finished and held).
        self.kv_connector = kv_connector
        self.remote_kv = (
            None
            if kv_connector is None
            else RemoteKVRequests(kv_connector, kv_cache_manager, self.waiting)
        )
        self.observer = observer or StepObserver(spec_policy, self.prefill_limits)

    @property
    def num_preemptions(self) -> int:
        return sum(self.num_preemptions_by_mode.values())

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """`request` is checked (engine/intake.py): fits the context, a new id."""
        assert not self.has_request(request.sample_id)
        assert request.num_tokens <= self.max_model_len
        if self.kv_cache_manager.enable_caching:
            # Hash the prompt now: data that cannot be hashed fails this call alone, not a
            # later step that every running request is part of.
            self.kv_cache_manager.block_hashes(request)
        self.requests[request.sample_id] = request
        self.waiting.add(request)

    def finish_requests(self, sample_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests that are not running this step (aborted, or finished before it ran):
        free their blocks now."""
        assert status.is_finished
        ids = {rid for rid in sample_ids if rid in self.requests}
        if not ids:
            return
        self.running = [r for r in self.running if r.sample_id not in ids]
        self.waiting.remove_ids(ids)
        for rid in ids:
            request = self.requests.pop(rid)
            request.status = status
            self._free(request)

    def free_finished(self, sample_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        """Free requests the output applier finished (their status says how); returns the
        KV connector's `kv_transfer_params` of those it gave any (for their last output)."""
        if not sample_ids:
            return {}
        ids = set(sample_ids)
        self.running = [r for r in self.running if r.sample_id not in ids]
        params = {req_id: self._free(self.requests.pop(req_id)) for req_id in sample_ids}
        return {req_id: p for req_id, p in params.items() if p is not None}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_request(self, sample_id: str) -> bool:
        """Whether the id is in use: a request here, or a finished one whose blocks the KV
        connector still moves."""
        return sample_id in self.requests or (
            self.remote_kv is not None and sample_id in self.remote_kv
        )

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    def set_itl_target(self, seconds: float) -> None:
        """Move the ITL target of an engine started with one (its cost model is calibrated)."""
        if self.observer.itl_feedback is None:
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
            kv_group_block_ids=self.kv_cache_manager.take_group_block_ids(),
        )
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(
                output, self.requests, self.kv_cache_manager.get_block_ids
            )
        self.finished_req_ids = set()
        self.observer.planned(output, self.requests, plan.cached_reqs.keys(), plan.prefill)
        return output

    def sampling_grammars(
        self, output: SchedulerOutput
    ) -> dict[str, tuple[RequestGrammar, list[int]]]:
        """The grammar and drafts of each constrained request that samples in the step
        `output` plans (its scheduled tokens reach its end): the rows the bitmask covers."""
        sampling = {}
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if request.grammar is None:
                continue
            drafts = output.scheduled_spec_tokens.get(req_id, [])
            if request.num_computed_tokens + num_new - len(drafts) == request.num_tokens:
                sampling[req_id] = (request.grammar, drafts)
        return sampling

    def _num_decode_tokens_running(self) -> int:
        """Tokens the running decodes will compute this step, drafts included (at most)."""
        return sum(
            1 + len(r.spec_token_ids)
            for r in self.running
            if r.num_tokens - r.num_computed_tokens == 1
        )

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
                if victim.sample_id in plan.num_scheduled:  # already given tokens: take back
                    plan.budget += plan.num_scheduled.pop(victim.sample_id)
                    del plan.cached_reqs[victim.sample_id]
                    plan.spec_tokens.pop(victim.sample_id, None)
                    index -= 1
                self.running.remove(victim)
                self._preempt(victim, plan)
                if victim is request:
                    break
            if new_block_ids is None:
                continue  # the request preempted itself; `index` now points past it
            plan.cached_reqs[request.sample_id] = CachedRequestData(
                request.sample_id, new_block_ids, request.num_computed_tokens
            )
            if drafts:
                plan.spec_tokens[request.sample_id] = drafts
            if is_prompt:
                self._book_prefill(plan, num_new, num_left, request.num_computed_tokens)
            plan.num_scheduled[request.sample_id] = num_new
            plan.budget -= num_new
            index += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        manager = self.kv_cache_manager
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.next_to_admit(self.kv_cache_manager)
            if request is None:  # every waiting request's grammar is still compiling
                break
            if manager.is_swapped(request) or manager.holds_blocks(request):
                # Swapped out, or its KV arrived through the connector: resumes where it was.
                num_cached = request.num_computed_tokens
                num_left = request.num_tokens - num_cached
                num_new = self._num_new_tokens(num_left, num_cached, plan, is_prompt=True)
                if num_new == 0 or not self._resume(request, num_new, plan):
                    break
            else:
                hits, num_hit = manager.get_computed_blocks(request)
                num_external, load_async = self._num_external_tokens(request, num_hit)
                if load_async:  # admitted with blocks for its KV; waits off the step for it
                    assert self.remote_kv is not None
                    if not self.remote_kv.admit(request, hits, num_hit, num_external):
                        break
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
                        request, manager.get_block_ids(request.sample_id), num_external
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
            plan.num_scheduled[request.sample_id] = num_new
            plan.budget -= num_new

    def _resume(self, request: Request, num_new: int, plan: _StepPlan) -> bool:
        """Blocks for `num_new` more tokens of a request that holds KV (swapped out: its
        blocks copied back in; loaded through the connector: only the new ones)."""
        manager = self.kv_cache_manager
        if not manager.is_swapped(request):
            lookahead = self._lookahead(request, num_new, plan)
            return manager.allocate_slots(request, num_new, (), lookahead) is not None
        pairs = manager.swap_in(request, num_new)
        if pairs is not None:
            plan.swap_in.extend(pairs)
        return pairs is not None

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

    def _pick_victim(self) -> Request:
        """FCFS preempts the most recently admitted request; priority the lowest-priority one
        (largest value), the most recently arrived among equals."""
        if self.policy != "priority":
            return self.running[-1]
        return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))

    def get_stats(self) -> SchedulerStats:
        manager = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_scheduled_tokens=self.observer.last_num_scheduled_tokens,
            num_preemptions=self.num_preemptions,
            num_kv_blocks_used=manager.num_blocks - manager.num_free_blocks,
            num_kv_blocks=manager.num_blocks,
            num_preemptions_by_mode=dict(self.num_preemptions_by_mode),
            prefix_cache=PrefixCacheStats(
                manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits
            ),
            spec_decode=copy.deepcopy(self.observer.spec_stats),
            itl_target=None
            if (itl := self.observer.itl_feedback) is None
            else replace(copy.deepcopy(itl.stats), itl_target=self.prefill_limits.itl_target),
        )

    # ---- internals ---------------------------------------------------------------------------

    def _may_admit(self) -> bool:
        """Under the static policy a batch is what one step admits (up to max_num_seqs and the
        token budget); nobody joins until every member has finished."""
        return self.policy != "static" or not self.running

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
        plan.preempted_ids.add(request.sample_id)
        self.waiting.add_preempted(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.sample_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(request.sample_id),
            num_computed_tokens=request.num_computed_tokens,
            lora=request.lora,
        )

    def _free(self, request: Request) -> dict[str, Any] | None:
        """Give a finished request's blocks back, unless the KV connector still moves them
        (then they are freed when it reports that transfer ended); returns the connector's
        `kv_transfer_params` for the request's last output."""
        params = None
        if self.remote_kv is not None:
            params = self.remote_kv.release(request)  # frees its blocks, or holds them
        else:
            self.kv_cache_manager.free(request)
        self.waiting.forget(request)
        self.finished_req_ids.add(request.sample_id)
        if request.grammar is not None:
            request.grammar.release()  # a compile nobody waits for is cancelled
        return params
