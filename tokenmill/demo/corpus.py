"""The demo models' training corpus and held-out eval set, generated from a seed.

Everything is deterministic: the same seed gives the same documents on every machine, and
the held-out set (another seed) is removed from the training corpus so `tokenmill eval`
measures what the models learned, not what they memorised.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterable, Iterator

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
    """The chat template's rendering of one user turn plus the assistant header.

    Written out by hand so corpus rendering is fast; a test checks it equals the tokenizer's
    `apply_chat_template` output.
    """
    turns = [("system", system)] if system is not None else []
    turns.append(("user", user_message))
    text = "".join(f"{IM_START_TOKEN}{role}\n{content}{IM_END_TOKEN}\n" for role, content in turns)
    return f"{BOS_TOKEN}{text}{IM_START_TOKEN}assistant\n"


def render(example: Example) -> tuple[str, str]:
    """(context, target): the text the model reads, then the text it learns to produce."""
    if example.prompt is None:
        return BOS_TOKEN, example.answer + EOS_TOKEN
    return chat_prompt(example.prompt, example.system), example.answer + IM_END_TOKEN
