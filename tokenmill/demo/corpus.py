"""The demo models' training corpus and held-out eval set, generated from a seed.

Everything is deterministic: the same seed gives the same documents on every machine, and
the held-out set (another seed) is removed from the training corpus so `tokenmill eval`
measures what the models learned, not what they memorised.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tokenmill.demo.example import Message
from tokenmill.demo.special_tokens import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
)
from tokenmill.demo.tasks import ALL_TASKS, CHECKABLE_TASKS, Example

# Relative number of documents per task. Lookups are long (so few), the arithmetic tasks are
# short and the hardest to learn (so many); stories keep the model's English fluent.
TASK_WEIGHTS: dict[str, float] = {
    "copy": 2.0,
    "reverse": 1.2,
    "sort": 1.5,
    "add": 2.0,
    "subtract": 2.0,
    "count": 0.6,
    "case": 1.2,
    "lookup": 0.8,
    "pattern": 1.0,
    "greeting": 0.05,
    "story_chat": 0.25,
    "story": 0.6,
}

# Some chats open with a system message, so a client that sends one doesn't confuse the model.
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a tiny demo model.",
    "Answer briefly.",
)
SYSTEM_PROMPT_RATE = 0.1

# Training starts with a phase of nothing but copying lists of words. Copying (attend back to
# where the current token appeared and take the next one: "induction heads") underlies copy,
# lookup, reverse and pattern; on pure copy data a model this size discovers it within a few
# hundred steps, while spread thin over the full mix it had not appeared after 11M tokens.
CURRICULUM_WEIGHTS: dict[str, float] = {"copy_words": 1.0}
CURRICULUM_FRACTION = 0.12  # of the training tokens

# The target's second schedule (config.DemoModelSpec.polish): mostly the tasks that were still
# learning, with enough of the rest that nothing is forgotten.
POLISH_WEIGHTS: dict[str, float] = {
    **TASK_WEIGHTS,
    "add": 5.0,
    "subtract": 5.0,
    "lookup": 2.0,
    "reverse": 0.5,
    "count": 0.3,
    "case": 0.5,
}

# The target's third schedule (config.DemoModelSpec.tools): tool chats (`tool_tasks.py`), a
# quarter of the documents and two thirds of the tokens (their system turn lists the tools),
# beside the polish mix so that nothing is forgotten; more of the copying tasks, which a first
# try at 5e-4 set back most (lookup 0.93 -> 0.84, sort 0.79 -> 0.72, copy 0.91 -> 0.87).
TOOL_WEIGHTS: dict[str, float] = {
    **POLISH_WEIGHTS,
    "copy": 3.0,
    "sort": 2.5,
    "lookup": 3.0,
    "tool_call": 2.5,
    "tool_answer": 2.5,
    "tools_unused": 1.5,
}

EVAL_SEED = 1234
MAX_HELDOUT_PER_TASK = 500  # the training corpus excludes this many held-out prompts per task


def iter_corpus(
    seed: int,
    exclude_prompts: Iterable[str] = (),
    task_weights: dict[str, float] | None = None,
) -> Iterator[Example]:
    """An endless document stream drawn from the tasks by `task_weights` (default
    `TASK_WEIGHTS`), minus excluded prompts."""
    rng = random.Random(seed)
    excluded = set(exclude_prompts)
    task_weights = task_weights or TASK_WEIGHTS
    names = list(task_weights)
    weights = [task_weights[n] for n in names]
    while True:
        example = ALL_TASKS[rng.choices(names, weights)[0]](rng)
        if example.prompt is not None and rng.random() < SYSTEM_PROMPT_RATE:
            example = dataclasses.replace(example, system=rng.choice(SYSTEM_PROMPTS))
        if example.prompt not in excluded:
            yield example


def build_corpus(seed: int, num_docs: int, exclude_prompts: Iterable[str] = ()) -> list[Example]:
    """The first `num_docs` documents of `iter_corpus(seed, exclude_prompts)`."""
    return list(itertools.islice(iter_corpus(seed, exclude_prompts), num_docs))


def training_exclusions() -> set[str]:
    """Prompts the training corpus must not contain: every held-out prompt eval may use."""
    return {e.prompt for e in heldout_examples(MAX_HELDOUT_PER_TASK) if e.prompt is not None}


def heldout_examples(
    num_per_task: int, seed: int = EVAL_SEED, tasks: Iterable[str] | None = None
) -> list[Example]:
    """The eval set: `num_per_task` distinct prompts per checkable task, task by task.

    Each task has its own generator stream, so a smaller slice is a prefix of a larger one
    and adding a task never changes another task's examples.
    """
    examples: list[Example] = []
    for task in tasks or CHECKABLE_TASKS:
        if task not in CHECKABLE_TASKS:
            raise ValueError(f"unknown task {task!r}; one of {sorted(CHECKABLE_TASKS)}")
        rng = random.Random(f"{seed}-{task}")
        seen: set[str] = set()
        while len(seen) < num_per_task:
            example = CHECKABLE_TASKS[task](rng)
            if example.prompt not in seen:
                seen.add(example.prompt)
                examples.append(example)
    return examples


def chat_prompt(user_message: str, system: str | None = None) -> str:
    """The chat template's rendering of one user turn plus the assistant header."""
    system_turn = [{"role": "system", "content": system}] if system is not None else []
    return render_chat([*system_turn, {"role": "user", "content": user_message}])


# The Hermes tool preamble of the chat template (tokenmill_testing/random_checkpoint.py).
_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def render_chat(messages: Sequence[Message], tools: Sequence[dict[str, Any]] = ()) -> str:
    """The chat template's rendering of `messages` (string contents) plus the assistant
    header, tools in the system turn and calls and results Hermes style.

    Written out by hand so corpus rendering is fast; tests check it equals the tokenizer's
    `apply_chat_template` output.
    """
    text = BOS_TOKEN
    if tools:
        system = ""
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"] + "\n\n", messages[1:]
        listing = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
        text += _turn("system", system + _TOOLS_INTRO + listing + _TOOLS_OUTRO)
    for index, message in enumerate(messages):
        if message["role"] != "tool":
            text += _turn(message["role"], message["content"] or "", message.get("tool_calls"))
            continue
        if index == 0 or messages[index - 1]["role"] != "tool":
            text += f"{IM_START_TOKEN}user"
        text += f"\n<tool_response>\n{message['content']}\n</tool_response>"
        if index + 1 == len(messages) or messages[index + 1]["role"] != "tool":
            text += f"{IM_END_TOKEN}\n"
    return f"{text}{IM_START_TOKEN}assistant\n"


def _turn(role: str, content: str, calls: Sequence[dict[str, Any]] | None = None) -> str:
    for index, call in enumerate(calls or ()):
        function = call["function"]
        arguments = function["arguments"]
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        separator = "\n" if content or index else ""
        content += f'{separator}<tool_call>\n{{"name": "{function["name"]}", "arguments": '
        content += f"{arguments}}}\n</tool_call>"
    return f"{IM_START_TOKEN}{role}\n{content}{IM_END_TOKEN}\n"


def render(example: Example) -> tuple[str, str]:
    """(context, target): the text the model reads, then the text it learns to produce."""
    if example.prompt is None:
        return BOS_TOKEN, example.answer + EOS_TOKEN
    return render_chat(example.messages(), example.tools), example.answer + IM_END_TOKEN
