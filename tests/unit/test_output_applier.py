"""The output applier (core/sched/output_applier.py): the one place that decides a request has
finished, stop strings included, and what the step observer hears of it. No tensors."""

from __future__ import annotations

from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.sched.output_applier import OutputApplier
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.request import Request, RequestStatus
from tokenmill.step.runner_output import ModelRunnerOutput


def make_scheduler() -> Scheduler:
    return Scheduler(
        KVCacheManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
    )


class FakeText:
    """A detokenizer per request: token 42 completes the stop string "END"."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = {}

    def __call__(self, req_id: str, token_ids: list[int]) -> str | None:
        self.seen.setdefault(req_id, []).extend(token_ids)
        return "END" if 42 in token_ids else None


def run_step(scheduler: Scheduler, applier: OutputApplier, tokens: dict[str, list[int]]):
    out = scheduler.schedule()
    ids = [r for r in out.num_scheduled_tokens if r in tokens]
    return applier.update_from_output(out, ModelRunnerOutput(ids, [tokens[r] for r in ids]))


def test_a_stop_string_ends_the_request_in_the_step_that_completes_it() -> None:
    scheduler, text = make_scheduler(), FakeText()
    applier = OutputApplier(scheduler, text)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(stop=["END"]), max_tokens=10))
    scheduler.add_request(Request("b", [4, 5, 6], SamplingParams(), max_tokens=10))
    run_step(scheduler, applier, {"a": [7], "b": [8]})
    [a, b] = run_step(scheduler, applier, {"a": [42], "b": [9]})
    assert (a.finish_reason, a.stop_reason, a.new_token_ids) == ("stop", "END", [42])
    assert b.finish_reason is None
    assert set(scheduler.requests) == {"b"}  # freed at once: nobody calls finish_requests
    assert scheduler.schedule().finished_req_ids == {"a"}  # the runner forgets it next step


def test_the_token_that_stops_a_request_is_not_in_its_text_unless_asked() -> None:
    scheduler, text = make_scheduler(), FakeText()
    applier = OutputApplier(scheduler, text)
    for req_id, include in (("hidden", False), ("shown", True)):
        params = SamplingParams(stop_token_ids=[9], include_stop_str_in_output=include)
        scheduler.add_request(Request(req_id, [1, 2], params, max_tokens=10))
    outputs = run_step(scheduler, applier, {"hidden": [9], "shown": [9]})
    assert [(o.finish_reason, o.stop_reason) for o in outputs] == [("stop", 9), ("stop", 9)]
    assert text.seen == {"hidden": [], "shown": [9]}


def test_a_stop_string_in_the_last_allowed_token_is_the_stop_reason() -> None:
    scheduler, text = make_scheduler(), FakeText()
    applier = OutputApplier(scheduler, text)
    scheduler.add_request(Request("a", [1, 2], SamplingParams(stop=["END"]), max_tokens=1))
    [a] = run_step(scheduler, applier, {"a": [42]})
    assert (a.finish_reason, a.stop_reason) == ("stop", "END")


def test_unrunnable_requests_finish_before_the_scheduler_plans() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(Request("empty", [1, 2], SamplingParams(max_tokens=0), max_tokens=0))
    [output] = OutputApplier(scheduler).finish_unrunnable()
    assert (output.req_id, output.finish_reason) == ("empty", "length")
    assert not scheduler.has_unfinished_requests()


def test_the_observer_hears_of_plans_prefills_and_accepted_drafts() -> None:
    scheduler = make_scheduler()
    applier = OutputApplier(scheduler)
    observer = scheduler.observer
    request = Request("a", list(range(10)), SamplingParams(ignore_eos=True), max_tokens=8)
    scheduler.add_request(request)
    run_step(scheduler, applier, {"a": [1]})
    assert (observer.num_prompt_tokens_scheduled, observer.num_prompt_tokens_prefilled) == (10, 10)
    observer.stepped(0.01, ModelRunnerOutput(["a"], [[1]]), now=123.0)
    [record], _ = observer.step_records.since(0)
    assert (record.num_prefill_tokens, record.num_decode_tokens, record.num_reqs) == (10, 0, 1)
    assert observer.num_steps == 1 and observer.num_generation_tokens == 1
    assert request.status == RequestStatus.RUNNING
