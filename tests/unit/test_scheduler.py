"""The token-budget scheduler, driven by a fake model (no tensors)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.sched.output_applier import OutputApplier
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.request import Request, RequestStatus
from tokenmill.step.runner_output import ModelRunnerOutput
from tokenmill.step.scheduler_output import SchedulerOutput


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 128,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
    )


def make_request(request_id: str, num_prompt: int, max_tokens: int, **params) -> Request:
    salt = sum(map(ord, request_id))
    prompt = [(7 * i + salt) % 50 for i in range(num_prompt)]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return Request(request_id, prompt, sampling, max_tokens=max_tokens)


def fake_next_token(token_ids: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole history."""
    return (sum(token_ids) * 31 + len(token_ids)) % 97


def fake_run(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    req_ids, tokens = [], []
    for req_id, num in out.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        if request.num_computed_tokens + num == request.num_tokens:
            req_ids.append(req_id)
            tokens.append([fake_next_token(request.all_token_ids)])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens)


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {r: [] for r in scheduler.requests}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        for core_output in OutputApplier(scheduler).update_from_output(
            out, fake_run(scheduler, out)
        ):
            outputs[core_output.req_id] += core_output.new_token_ids
    assert not scheduler.has_unfinished_requests(), "requests never finished"
    return outputs


def expected_output(request: Request) -> list[int]:
    tokens = list(request.prompt_token_ids)
    for _ in range(request.max_tokens):
        tokens.append(fake_next_token(tokens))
    return tokens[request.num_prompt_tokens :]


def test_prefill_chunks_and_decodes_share_one_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("short", 3, max_tokens=5))
    scheduler.add_request(make_request("long", 25, max_tokens=2))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"short": 3, "long": 7}
    OutputApplier(scheduler).update_from_output(first, fake_run(scheduler, first))
    second = scheduler.schedule()
    # The decode of "short" goes first; the rest of the budget continues the long prompt.
    assert second.num_scheduled_tokens == {"short": 1, "long": 9}


def test_every_waiting_request_is_chunked_not_only_the_first() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 20, max_tokens=1))
    chunks: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for req_id, num in out.num_scheduled_tokens.items():
            chunks[req_id].append(num)
        OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))
    assert all(sum(c) == 20 and len(c) > 1 for c in chunks.values()), chunks


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 10, max_tokens=3))
    scheduler.add_request(make_request("b", 10, max_tokens=3))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 10}


def test_max_num_seqs_caps_the_running_batch() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 2, max_tokens=4))
    out = scheduler.schedule()
    assert len(out.num_scheduled_tokens) == 2
    assert len(scheduler.waiting) == 3


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first() -> None:
    # 6 blocks of 4 slots; three requests of 8-token prompts take 2 blocks each.
    scheduler = make_scheduler(num_blocks=6, max_model_len=32)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 8, max_tokens=6))
    first = scheduler.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r1", "r2"}
    OutputApplier(scheduler).update_from_output(first, fake_run(scheduler, first))
    # Each now has 9 tokens; the next decode needs a third block each.
    second = scheduler.schedule()
    assert second.preempted_req_ids == {"r2"}
    assert scheduler.waiting[0].sample_id == "r2"
    assert scheduler.waiting[0].status == RequestStatus.PREEMPTED
    assert scheduler.waiting[0].num_computed_tokens == 0
    assert scheduler.num_preemptions == 1


@given(
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 12), min_size=8, max_size=8),
    budget=st.integers(4, 48),
    num_blocks=st.integers(13, 40),
    max_num_seqs=st.integers(1, 6),
)
@settings(max_examples=80, deadline=None)
def test_every_request_finishes_with_the_output_it_would_have_alone(
    prompt_lens: list[int], max_tokens: list[int], budget: int, num_blocks: int, max_num_seqs: int
) -> None:
    # max_model_len 52 = 13 blocks of 4: any one request always fits the pool.
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=52,
    )
    requests = [
        make_request(f"r{i}", n, max_tokens=m)
        for i, (n, m) in enumerate(zip(prompt_lens, max_tokens))
    ]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler)
    for request in requests:
        assert outputs[request.sample_id] == expected_output(request), request
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"


def test_preempted_requests_resume_with_identical_output() -> None:
    scheduler = make_scheduler(num_blocks=13, max_model_len=52, max_num_batched_tokens=64)
    requests = [make_request(f"r{i}", 10 + i, max_tokens=20) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    for request in requests:
        assert outputs[request.sample_id] == expected_output(request)


def test_a_prompt_recomputed_after_preemption_counts_once_as_prompt() -> None:
    scheduler = make_scheduler(num_blocks=13, max_model_len=52, max_num_batched_tokens=64)
    requests = [make_request(f"r{i}", 10 + i, max_tokens=20) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    num_prompt_tokens = sum(r.num_prompt_tokens for r in requests)
    assert scheduler.observer.num_prompt_tokens_prefilled == num_prompt_tokens
    assert scheduler.observer.num_prompt_tokens_scheduled > num_prompt_tokens  # recomputed prompts


def test_a_sequence_never_grows_past_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=20)
    request = make_request("r", 15, max_tokens=100)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert request.num_tokens == 20
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_and_eos_end_a_request_only_after_min_tokens() -> None:
    scheduler = make_scheduler()
    first_token = fake_next_token(make_request("r", 4, 1).all_token_ids)
    params = SamplingParams(max_tokens=10, stop_token_ids=[first_token], min_tokens=0)
    request = Request("r", make_request("r", 4, 1).prompt_token_ids, params, max_tokens=10)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == first_token
    assert request.num_output_tokens == 1


def test_aborting_frees_blocks_and_tells_the_runner() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 9, max_tokens=5))
    out = scheduler.schedule()
    OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
    assert scheduler.schedule().finished_req_ids == {"a"}


def test_static_policy_admits_nobody_until_the_whole_batch_has_finished() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    scheduler.policy = "static"
    scheduler.add_request(make_request("short", 3, max_tokens=2))
    scheduler.add_request(make_request("long", 3, max_tokens=6))
    scheduler.add_request(make_request("next", 3, max_tokens=2))
    batches: list[set[str]] = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        batches.append(set(out.num_scheduled_tokens))
        OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))
    # "next" waits through the steps where only "long" is left, then runs alone.
    assert batches[0] == {"short", "long"}
    first_next = next(i for i, b in enumerate(batches) if "next" in b)
    assert all("long" not in b for b in batches[first_next:])
    assert batches[first_next - 1] == {"long"}


def test_continuous_policy_admits_as_soon_as_a_slot_frees() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for name, max_tokens in (("short", 2), ("long", 6), ("next", 2)):
        scheduler.add_request(make_request(name, 3, max_tokens=max_tokens))
    batches: list[set[str]] = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        batches.append(set(out.num_scheduled_tokens))
        OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))
    assert {"long", "next"} in batches
