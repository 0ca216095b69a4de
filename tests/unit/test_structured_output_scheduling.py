"""The scheduler and grammars still compiling: such a request waits in the queue, keeping its
place, while the requests behind it are admitted; it runs as soon as its grammar is ready."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from test_scheduler import make_request, make_scheduler

from tokenmill.core.sched.output_applier import OutputApplier
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.step.request import RequestStatus
from tokenmill.structured_output.request_grammar import RequestGrammar


class FakeBackend:
    def matcher(self, compiled: object, stop_token_ids: list[int]) -> object:
        return ("matcher", compiled)


def pending_grammar() -> tuple[RequestGrammar, Future]:
    compiled: Future = Future()
    backend: Future = Future()
    backend.set_result(FakeBackend())
    return RequestGrammar(compiled, backend, stop_token_ids=[]), compiled


def test_request_compiling_its_grammar_waits_without_blocking_others() -> None:
    scheduler = make_scheduler()
    grammar, compiled = pending_grammar()
    constrained = make_request("constrained", 8, 4)
    constrained.grammar = grammar
    scheduler.add_request(constrained)
    scheduler.add_request(make_request("free", 8, 4))

    first = scheduler.schedule()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["free"]
    assert constrained.status == RequestStatus.WAITING

    compiled.set_result("compiled grammar")
    second = scheduler.schedule()
    assert [r.req_id for r in second.scheduled_new_reqs] == ["constrained"]
    assert grammar.matcher == ("matcher", "compiled grammar")


def test_grammar_that_fails_to_compile_finishes_the_request_with_the_reason() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("free", 8, 4))
    scheduler.schedule()  # "free" holds the only seat: nothing is admitted for a while
    grammar, compiled = pending_grammar()
    request = make_request("bad", 8, 4)
    request.grammar = grammar
    scheduler.add_request(request)
    compiled.set_exception(RuntimeError("too deep"))

    (output,) = OutputApplier(scheduler).finish_unrunnable()
    assert output.req_id == "bad"
    assert output.finish_reason == "error" and "too deep" in str(output.stop_reason)
    assert list(scheduler.requests) == ["free"]


def test_validated_constraints_are_remembered_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokenmill.structured_output import backend

    checked: list[str] = []
    monkeypatch.setattr(backend, "_check", lambda params: checked.append(params.regex))
    monkeypatch.setattr(backend, "MAX_VALIDATED_KEYS", 3)
    monkeypatch.setattr(backend, "_validated", type(backend._validated)())
    for regex in ["a", "b", "c", "a", "d", "a", "b"]:
        backend.validate(StructuredOutputsParams(regex=regex, param="regex"))
    # "a" asked again is a lookup that keeps it; "d" pushes out the oldest, "b", checked anew.
    assert checked == ["a", "b", "c", "d", "b"]


class RecordingMatcher:
    """Accepts every token and remembers them."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def is_terminated(self) -> bool:
        return False


# Token ids spelling "I think.</think>{}" in several pieces, the end tag split over three.
PIECES = {1: "I", 2: " think", 3: ".</", 4: "th", 5: "ink>", 6: "{", 7: "}"}


def reasoning_grammar() -> RequestGrammar:
    compiled: Future = Future()
    compiled.set_result("compiled grammar")
    backend: Future = Future()
    backend.set_result(FakeBackend())
    grammar = RequestGrammar(
        compiled, backend, [], reasoning_end="</think>", token_text=PIECES.__getitem__
    )
    assert grammar.is_ready()
    grammar.matcher = RecordingMatcher()
    return grammar


def test_the_grammar_starts_after_the_reasoning_end_written_in_pieces() -> None:
    grammar = reasoning_grammar()
    assert grammar.accept_tokens([1, 2, 3, 4]) and grammar.in_reasoning
    assert grammar.matcher.accepted == []  # the reasoning is free
    assert grammar.accept_tokens([5, 6])  # ends the reasoning; "{" is the grammar's first
    assert not grammar.in_reasoning and grammar.matcher.accepted == [6]


def test_drafts_stop_before_the_one_that_ends_the_reasoning() -> None:
    """Rows after that draft would need the grammar's first mask: it waits a step."""
    grammar = reasoning_grammar()
    grammar.accept_tokens([1])
    assert grammar.valid_prefix([2, 3, 4, 5, 6]) == [2, 3, 4]
    assert grammar.valid_prefix([2, 3]) == [2, 3]
    assert grammar.in_reasoning and grammar.matcher.accepted == []
