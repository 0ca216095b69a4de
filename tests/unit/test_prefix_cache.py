"""Prefix caching, swap and priorities in the KV cache manager and scheduler (no model)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.core.kv.cache_manager import KVCacheManager, cdiv
from tokenmill.core.sched.output_applier import OutputApplier
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.request import Request, RequestStatus
from tokenmill.step.runner_output import ModelRunnerOutput

BLOCK = 4


def request(request_id: str, tokens: list[int], salt: str | None = None, **kwargs) -> Request:
    params = SamplingParams(max_tokens=kwargs.pop("max_tokens", 4), ignore_eos=True)
    return Request(
        request_id, tokens, params, max_tokens=params.max_tokens, cache_salt=salt, **kwargs
    )


def admit(manager: KVCacheManager, req: Request) -> int:
    """Look up, allocate and mark the prompt computed; returns the tokens that hit."""
    hits, num_hit = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    manager.cache_computed_blocks(req)  # as the scheduler does once the step has run
    return num_hit


def test_a_shared_prefix_hits_whole_blocks_only() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    admit(manager, request("a", list(range(10))))  # blocks [0-3] [4-7] full, [8-9] partial
    assert admit(manager, request("b", [*range(10), 99])) == 8
    assert admit(manager, request("c", [*range(6), 50, 51])) == 4


def test_when_every_token_hits_the_last_block_is_recomputed() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    admit(manager, request("a", list(range(12))))
    # An exact repeat: all 3 blocks are cached, but the last token needs logits.
    assert admit(manager, request("b", list(range(12)))) == 8


def test_freed_blocks_stay_cached_until_evicted_tail_first() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    a = request("a", list(range(12)))
    admit(manager, a)
    manager.free(a)
    assert admit(manager, request("b", [*range(8), 7, 7, 7, 7, 7])) == 8
    # b holds a's first two blocks plus two new ones (one was a's evicted third block).
    assert manager.get_computed_blocks(request("c", list(range(13))))[1] == 8


def test_allocated_blocks_are_findable_only_once_computed() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    a = request("a", list(range(12)))
    assert manager.allocate_slots(a, a.num_tokens) is not None
    # Slots given but never written (the step failed, or the request was taken back).
    assert manager.get_computed_blocks(request("b", list(range(13))))[1] == 0
    a.num_computed_tokens = 6  # a first chunk ran: one full block is written
    manager.cache_computed_blocks(a)
    assert manager.get_computed_blocks(request("c", list(range(13))))[1] == 4


def test_a_step_that_never_completes_leaves_nothing_in_the_prefix_cache() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(request("a", list(range(12))))
    out = scheduler.schedule()  # slots allocated; the runner fails, update never comes
    assert out.num_scheduled_tokens == {"a": 12}
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ERROR)
    assert scheduler.kv_cache_manager.block_pool.cached_blocks == {}
    scheduler.add_request(request("b", list(range(13))))
    scheduler.schedule()
    assert scheduler.requests["b"].num_computed_tokens == 0


def test_a_victim_taken_back_within_schedule_registers_no_hash() -> None:
    """Priority preemption can take back a request already given slots in the same
    `schedule()`: the block its decode was about to fill must not become findable."""
    scheduler = make_scheduler(num_blocks=3, policy="priority", max_num_batched_tokens=16)
    scheduler.add_request(request("low", list(range(6)), priority=1, max_tokens=8))
    OutputApplier(scheduler).update_from_output(
        scheduler.schedule(), ModelRunnerOutput(["low"], [[1]])
    )
    scheduler.add_request(request("high", [50, 51, 52, 53], priority=0, max_tokens=8))
    both = scheduler.schedule()
    OutputApplier(scheduler).update_from_output(
        both, ModelRunnerOutput(["low", "high"], [[1], [1]])
    )
    pool = scheduler.kv_cache_manager.block_pool
    registered = []
    real_cache_block = pool.cache_block
    pool.cache_block = lambda block, block_hash: (  # type: ignore[method-assign]
        registered.append(block.block_id),
        real_cache_block(block, block_hash),
    )
    # low's decode fills its second block; high then needs a block: low is taken back.
    out = scheduler.schedule()
    assert "low" in out.preempted_req_ids and set(out.num_scheduled_tokens) == {"high"}
    assert registered == []


def test_cache_salt_isolates_tenants() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    admit(manager, request("a", list(range(12)), salt="tenant-1"))
    assert admit(manager, request("b", list(range(13)), salt="tenant-2")) == 0
    assert admit(manager, request("c", list(range(13)))) == 0
    assert admit(manager, request("d", list(range(13)), salt="tenant-1")) == 12


def test_reset_forgets_every_prefix() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    admit(manager, request("a", list(range(12))))
    manager.reset_prefix_cache()
    assert admit(manager, request("b", list(range(13)))) == 0


def test_disabled_caching_never_hits() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_caching=False)
    admit(manager, request("a", list(range(12))))
    assert admit(manager, request("b", list(range(13)))) == 0


def test_requests_wanting_prompt_logprobs_are_not_served_from_cache() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    admit(manager, request("a", list(range(12))))
    b = request("b", list(range(13)))
    b.sampling_params = SamplingParams(prompt_logprobs=1)
    assert manager.get_computed_blocks(b) == ([], 0)


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5]]


class CachingManagerMachine(RuleBasedStateMachine):
    """Allocate with cache hits, grow, free, swap out and in, reset: every block is owned by
    exactly its ref count of tables, free blocks are exactly those with no owner, and the
    prefix-cache map only points at blocks carrying that hash."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(num_blocks=12, block_size=BLOCK, num_swap_blocks=6)
        self.live: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.counter = 0

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=9))
    def add(self, prefix: list[int], tail: list[int]) -> None:
        req = request(f"r{self.counter}", prefix + tail)
        self.counter += 1
        hits, num_hit = self.manager.get_computed_blocks(req)
        assert num_hit % BLOCK == 0 and num_hit < req.num_tokens
        if self.manager.allocate_slots(req, req.num_tokens - num_hit, hits) is None:
            assert self.manager.get_block_ids(req.sample_id) == []
            return
        req.num_computed_tokens = req.num_tokens
        self.manager.cache_computed_blocks(req)
        self.live[req.sample_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.append_output_token(token)
        if self.manager.allocate_slots(req, 1) is not None:
            req.num_computed_tokens += 1
            self.manager.cache_computed_blocks(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.manager.free(self.live.pop(data.draw(st.sampled_from(sorted(self.live)))))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        num_blocks = len(self.manager.get_block_ids(req.sample_id))
        pairs = self.manager.swap_out(req)
        if pairs is not None:
            assert len(pairs) == num_blocks
            self.swapped[req.sample_id] = self.live.pop(req.sample_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        req = self.swapped[data.draw(st.sampled_from(sorted(self.swapped)))]
        if self.manager.swap_in(req, 0) is not None:
            self.live[req.sample_id] = self.swapped.pop(req.sample_id)
            assert len(self.manager.get_block_ids(req.sample_id)) == cdiv(
                req.num_computed_tokens, BLOCK
            )

    @rule()
    def reset(self) -> None:
        self.manager.reset_prefix_cache()

    @invariant()
    def reference_counts_match_owners(self) -> None:
        owners: dict[int, int] = {}
        for req_id in self.live:
            ids = self.manager.get_block_ids(req_id)
            assert len(ids) == len(set(ids)), "a table holds a block twice"
            for block_id in ids:
                owners[block_id] = owners.get(block_id, 0) + 1
        pool = self.manager.block_pool
        free = {b.block_id for b in pool.free_block_queue}
        for block in pool.blocks:
            assert block.ref_cnt == owners.get(block.block_id, 0), block
            assert (block.ref_cnt == 0) == (block.block_id in free), block
        assert pool.num_free_blocks == len(free)

    @invariant()
    def prefix_map_points_at_blocks_with_that_hash(self) -> None:
        for block_hash, block in self.manager.block_pool.cached_blocks.items():
            assert block.block_hash == block_hash

    @invariant()
    def only_computed_blocks_are_findable(self) -> None:
        """A block in the prefix cache holds KV that was written (here: marked computed)."""
        for req in self.live.values():
            blocks = self.manager.req_to_blocks[req.sample_id]
            for index, block in enumerate(blocks):
                if block.block_hash is not None:
                    assert (index + 1) * BLOCK <= req.num_computed_tokens, (req, index)

    @invariant()
    def swap_pool_holds_exactly_the_swapped_requests(self) -> None:
        swap_pool = self.manager.swap_pool
        assert swap_pool is not None
        used = sum(len(b) for b in self.manager.req_to_swapped_blocks.values())
        assert set(self.manager.req_to_swapped_blocks) == set(self.swapped)
        assert swap_pool.num_free_blocks == swap_pool.num_blocks - used

    def teardown(self) -> None:
        for req in [*self.live.values(), *self.swapped.values()]:
            self.manager.free(req)
        assert self.manager.num_free_blocks == self.manager.num_blocks
        assert self.manager.swap_pool.num_free_blocks == self.manager.swap_pool.num_blocks


TestCachingManager = CachingManagerMachine.TestCase
TestCachingManager.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def run_scheduler(scheduler: Scheduler) -> list[list[str]]:
    """Steps until done with a fake model that samples token 1; returns who ran each step."""
    steps = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        steps.append(list(out.num_scheduled_tokens))
        ids = [
            r
            for r, n in out.num_scheduled_tokens.items()
            if scheduler.requests[r].num_computed_tokens + n == scheduler.requests[r].num_tokens
        ]
        OutputApplier(scheduler).update_from_output(out, ModelRunnerOutput(ids, [[1]] * len(ids)))
    return steps


def make_scheduler(num_blocks: int = 64, **kwargs) -> Scheduler:
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_num_batched_tokens", 64)
    kwargs.setdefault("max_model_len", 64)
    caching = kwargs.pop("enable_caching", True)
    swap_blocks = kwargs.pop("num_swap_blocks", 0)
    manager = KVCacheManager(num_blocks, BLOCK, enable_caching=caching, num_swap_blocks=swap_blocks)
    return Scheduler(manager, **kwargs)


def test_priority_policy_admits_lower_values_first() -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    for name, priority in (("late", 5), ("urgent", -1), ("normal", 0)):
        scheduler.add_request(request(name, [hash(name) % 90 + 1] * 3, priority=priority))
    order = []
    for step in run_scheduler(scheduler):
        if step and step[0] not in order:
            order.append(step[0])
    assert order == ["urgent", "normal", "late"]


def test_priority_policy_preempts_the_lowest_priority_running_request() -> None:
    # 6 blocks; three 8-token prompts take 2 blocks each, then each decode needs a third.
    scheduler = make_scheduler(num_blocks=6, policy="priority", max_model_len=32)
    for name, priority in (("low", 9), ("high", 0), ("mid", 5)):
        scheduler.add_request(request(name, [ord(name[0])] * 8, priority=priority, max_tokens=3))
    first = scheduler.schedule()
    OutputApplier(scheduler).update_from_output(
        first, ModelRunnerOutput(list(first.num_scheduled_tokens), [[1]] * 3)
    )
    second = scheduler.schedule()
    assert second.preempted_req_ids == {"low"}
    assert "low" not in second.num_scheduled_tokens
    assert scheduler.waiting[0].sample_id == "low"


def test_swap_preemption_keeps_progress_and_swaps_back_in() -> None:
    scheduler = make_scheduler(
        num_blocks=6, num_swap_blocks=6, preemption_mode="swap", max_model_len=32
    )
    for name in ("a", "b", "c"):
        scheduler.add_request(request(name, [ord(name)] * 8, max_tokens=3))
    first = scheduler.schedule()
    OutputApplier(scheduler).update_from_output(
        first, ModelRunnerOutput(list(first.num_scheduled_tokens), [[1]] * 3)
    )
    second = scheduler.schedule()
    assert second.preempted_req_ids == {"c"}
    assert len(second.blocks_to_swap_out) == 2
    victim = scheduler.requests["c"]
    assert victim.num_computed_tokens == 8 and victim.status == RequestStatus.PREEMPTED
    assert scheduler.get_stats().num_preemptions_by_mode == {"recompute": 0, "swap": 1}
    swapped_in = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        swapped_in += out.blocks_to_swap_in
        done = [
            r
            for r, n in out.num_scheduled_tokens.items()
            if scheduler.requests[r].num_computed_tokens + n == scheduler.requests[r].num_tokens
        ]
        OutputApplier(scheduler).update_from_output(out, ModelRunnerOutput(done, [[1]] * len(done)))
    assert len(swapped_in) == 2
    assert scheduler.kv_cache_manager.swap_pool.num_free_blocks == 6


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full() -> None:
    scheduler = make_scheduler(
        num_blocks=6, num_swap_blocks=1, preemption_mode="swap", max_model_len=32
    )
    for name in ("a", "b", "c"):
        scheduler.add_request(request(name, [ord(name)] * 8, max_tokens=3))
    run_scheduler(scheduler)
    stats = scheduler.get_stats()
    assert stats.num_preemptions_by_mode["recompute"] >= 1
    assert stats.num_preemptions_by_mode["swap"] == 0


def test_cache_aware_admission_prefers_cached_prefixes_within_a_bound() -> None:
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    shared = list(range(1, 17))
    scheduler.add_request(request("warm", [*shared, 40], max_tokens=1))
    run_scheduler(scheduler)  # leaves 4 cached blocks of `shared`
    scheduler.add_request(request("cold", [50 + i for i in range(17)], max_tokens=1))
    for i in range(6):
        scheduler.add_request(request(f"hit{i}", [*shared, 60 + i], max_tokens=1))
    admitted = []
    for step in run_scheduler(scheduler):
        for req_id in step:
            if req_id not in admitted:
                admitted.append(req_id)
    # Requests with cached prefixes jump the queue, but "cold" waits at most 4 admissions.
    assert admitted.index("cold") == 4
    assert admitted[:4] == ["hit0", "hit1", "hit2", "hit3"]


def test_prefix_cache_statistics_count_prompt_tokens() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(request("a", list(range(1, 13))))
    run_scheduler(scheduler)
    scheduler.add_request(request("b", list(range(1, 13))))
    run_scheduler(scheduler)
    stats = scheduler.get_stats().prefix_cache
    assert (stats.queries, stats.hits) == (24, 8)


def test_prompt_tokens_count_whole_prompts_once_cached_ones_too() -> None:
    """As vLLM counts them: every prompt token once (cache hits included), with the cached
    ones and the ones run through the model counted apart."""
    scheduler = make_scheduler()
    for name in ("a", "b"):
        scheduler.add_request(request(name, list(range(1, 13))))
        run_scheduler(scheduler)
    assert scheduler.observer.num_prompt_tokens_prefilled == 24
    assert scheduler.observer.num_cached_prompt_tokens_prefilled == 8
    assert scheduler.observer.num_prompt_tokens_scheduled == 16


def test_requests_that_bypass_the_prefix_cache_are_not_lookups() -> None:
    """Prompt logprobs need every position's logits, so such a request reads no cache and is
    not counted as a query (vLLM), nor is any request with caching off."""
    scheduler = make_scheduler()
    scheduler.add_request(request("a", list(range(1, 13))))
    run_scheduler(scheduler)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scheduler.add_request(Request("scored", list(range(1, 13)), params, max_tokens=1))
    run_scheduler(scheduler)
    assert (
        scheduler.get_stats().prefix_cache.queries,
        scheduler.observer.num_cached_prompt_tokens_prefilled,
    ) == (12, 0)
    uncached = make_scheduler(enable_caching=False)
    uncached.add_request(request("c", list(range(1, 13))))
    run_scheduler(uncached)
    assert uncached.get_stats().prefix_cache.queries == 0
    assert uncached.observer.num_prompt_tokens_prefilled == 12
