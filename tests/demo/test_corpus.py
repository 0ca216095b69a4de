"""The synthetic corpus: reproducible by seed, correct answers, held-out prompts kept out."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from tokenmill.demo.corpus import (
    CURRICULUM_WEIGHTS,
    MAX_HELDOUT_PER_TASK,
    POLISH_WEIGHTS,
    TOOL_WEIGHTS,
    build_corpus,
    heldout_examples,
    iter_corpus,
    training_exclusions,
)
from tokenmill.demo.tasks import CHECKABLE_TASKS, Example


def test_same_seed_gives_the_same_corpus_and_another_seed_does_not() -> None:
    assert build_corpus(7, 300) == build_corpus(7, 300)
    assert build_corpus(7, 300) != build_corpus(8, 300)


def test_corpus_mixes_every_task() -> None:
    tasks = {e.task for e in build_corpus(0, 2000)}
    assert set(CHECKABLE_TASKS) - {"tool_call", "tool_answer"} <= tasks
    assert {"story", "story_chat", "greeting"} <= tasks
    tool_mix = {e.task for e in itertools.islice(iter_corpus(0, (), TOOL_WEIGHTS), 2000)}
    assert set(TOOL_WEIGHTS) == tool_mix


def test_tools_unused_offers_the_tool_to_a_question_it_does_not_serve() -> None:
    for e in itertools.islice(iter_corpus(0, (), {"tools_unused": 1.0}), 200):
        assert any(t["function"]["name"] == "multiply" for t in e.tools)
        assert "<tool_call>" not in e.answer and not e.turns


def test_heldout_slices_are_prefixes_of_larger_slices() -> None:
    small, large = heldout_examples(3), heldout_examples(10)
    for task in CHECKABLE_TASKS:
        assert [e for e in small if e.task == task] == [e for e in large if e.task == task][:3]


def test_heldout_set_depends_on_its_seed_only() -> None:
    assert heldout_examples(5, seed=1) == heldout_examples(5, seed=1)
    assert heldout_examples(5, seed=1) != heldout_examples(5, seed=2)
    assert heldout_examples(4, tasks=["add"]) == [e for e in heldout_examples(4) if e.task == "add"]


@pytest.mark.parametrize("weights", [None, CURRICULUM_WEIGHTS, POLISH_WEIGHTS, TOOL_WEIGHTS])
def test_training_corpus_contains_no_heldout_prompt(weights) -> None:
    """The streams train.py draws from (main mix, copy curriculum, polish mix) drop every
    held-out prompt, which they would otherwise contain."""
    excluded = training_exclusions()
    for task in CHECKABLE_TASKS:  # a multiplication may be held out of both tool tasks
        prompts = {e.prompt for e in heldout_examples(MAX_HELDOUT_PER_TASK, tasks=[task])}
        assert len(prompts) == MAX_HELDOUT_PER_TASK and prompts <= excluded
    unfiltered = itertools.islice(iter_corpus(0, (), weights), 20_000)
    if weights is not CURRICULUM_WEIGHTS:  # 5-20 random words: never a held-out prompt
        assert any(d.prompt in excluded for d in unfiltered)
    filtered = itertools.islice(iter_corpus(0, excluded, weights), 20_000)
    assert not any(d.prompt in excluded for d in filtered)


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def _check_answer(e: Example) -> None:
    """An independent reading of each task's prompt, so a generator bug can't teach nonsense."""
    prompt = e.prompt or ""
    listing = prompt.split(":", 1)[-1].split("?", 1)[-1].strip()
    if e.task == "copy":
        assert prompt.endswith("\n" + e.answer)
    elif e.task == "reverse":
        assert e.answer.split() == listing.split()[::-1]
    elif e.task == "sort":
        assert _numbers(e.answer) == sorted(_numbers(listing))
    elif e.task in ("add", "subtract"):
        a, b = _numbers(prompt)
        if prompt.startswith("Subtract"):
            a, b = b, a
        assert int(e.answer) == (a + b if e.task == "add" else a - b) >= 0
    elif e.task == "count":
        assert int(e.answer) == len(listing.split(","))
    elif e.task == "case":
        assert e.answer in (listing.upper(), listing.lower()) and e.answer != listing
    elif e.task == "lookup":  # the reply quotes the one table line of the asked-for key
        key = prompt.rsplit(" ", 1)[-1].rstrip("?")
        assert e.answer.startswith(f"- {key}: ") and _numbers(e.answer)
        assert f"\n{e.answer}\n" in prompt and prompt.count(f"- {key}:") == 1
    elif e.task == "pattern":
        assert len(e.answer.split()) == 3
    elif e.task in ("tool_call", "tool_answer"):
        _check_tool_chat(e, *_numbers(prompt))
    else:
        pytest.fail(f"no check for task {e.task}")


def _check_tool_chat(e: Example, a: int, b: int) -> None:
    """The call names multiply with the operands under its own parameter names; the answer
    states the product the tool returned."""
    [tool] = [t["function"] for t in e.tools if t["function"]["name"] == "multiply"]
    first, second = tool["parameters"]["required"]
    call = {"name": "multiply", "arguments": {first: a, second: b}}
    if e.task == "tool_call":
        assert e.answer == f"<tool_call>\n{json.dumps(call)}\n</tool_call>" and not e.turns
        return
    assistant, result = e.turns
    [made] = assistant["tool_calls"]
    assert json.loads(made["function"]["arguments"]) == call["arguments"]
    assert result["tool_call_id"] == made["id"]
    assert _numbers(result["content"]) == [a * b]
    assert e.answer == f"{a} times {b} is {a * b}."


@pytest.mark.parametrize("task", sorted(CHECKABLE_TASKS))
def test_every_answer_is_right(task: str) -> None:
    rng = random.Random(0)
    for _ in range(200):
        _check_answer(CHECKABLE_TASKS[task](rng))
