"""Instructions with checkable answers: what the demo models learn and `tokenmill eval` scores.

Each task turns a `random.Random` into an `Example` (user message, exact expected reply).
Answers are short and always in the same format, and the inputs are small (lists of 3-8
items, numbers below 100), because a model of a few million parameters trained for under an
hour on a CPU can learn that much. `copy` and `reverse` echo long spans of the prompt (where
prompt-lookup speculation shines); `lookup` hides one fact in a context of up to ~900 tokens
(where prefix caching and chunked prefill matter).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from tokenmill.demo.example import Example
from tokenmill.demo.stories import story, story_request, story_sentences, words
from tokenmill.demo.tool_tasks import offered_tools, tool_answer, tool_call

__all__ = ["ALL_TASKS", "CHECKABLE_TASKS", "Example"]

# Everyday nouns for the list tasks (most become single tokens).
NOUNS = words(
    "apple|banana|cherry|grape|lemon|mango|orange|peach|pear|plum|bread|cheese|cookie|egg"
    "|milk|rice|soup|tea|cake|honey|cat|dog|fox|owl|frog|bear|duck|fish|horse|mouse|lion"
    "|sheep|goat|bird|ball|book|box|chair|clock|cup|door|hat|key|lamp|pen|ring|shoe|sock|spoon"
    "|table|bell|boat|car|kite|train|tree|river|moon|star|sun|rain|snow|cloud|hill|road|stone"
    "|flower|leaf|shell|drum"
)
COLORS = words("red|blue|green|yellow|black|white|pink|purple|brown|gray")
SHAPES = words("circle|square|star|heart|moon|triangle")


def _phrase(rng: random.Random, words: tuple[str, ...], low: int, high: int) -> list[str]:
    return [rng.choice(words) for _ in range(rng.randint(low, high))]


def copy_passage(rng: random.Random) -> Example:
    """Story passages half the time, else a list of words or of numbers."""
    kind = rng.random()
    if kind < 0.35:
        return copy_words(rng)
    if kind < 0.5:
        passage = " ".join(str(rng.randrange(1000)) for _ in range(rng.randint(4, 16)))
    else:
        sentences = story_sentences(rng)
        start = rng.randrange(len(sentences))
        passage = " ".join(sentences[start : start + rng.randint(1, 4)])
    return Example("copy", f"{_copy_intro(rng)}\n{passage}", passage)


def copy_words(rng: random.Random) -> Example:
    """A list of random words to copy. It can't be guessed from grammar, so the model must learn
    to copy by attending to the prompt ("induction heads"), which then serves every echoing
    task. Training starts with these (see corpus.CURRICULUM_WEIGHTS)."""
    passage = " ".join(_phrase(rng, NOUNS + COLORS, 5, 20))
    return Example("copy", f"{_copy_intro(rng)}\n{passage}", passage)


def _copy_intro(rng: random.Random) -> str:
    return rng.choice(
        ("Repeat this text exactly:", "Copy the following text:", "Say this back to me:")
    )


def reverse_words(rng: random.Random) -> Example:
    words = rng.sample(NOUNS, rng.randint(3, 8))
    intro = rng.choice(
        ("Reverse the order of these words:", "Reverse this list:", "Say these words backwards:")
    )
    return Example("reverse", f"{intro} {' '.join(words)}", " ".join(reversed(words)))


def sort_numbers(rng: random.Random) -> Example:
    numbers = [rng.randrange(100) for _ in range(rng.randint(3, 7))]
    intro = rng.choice(
        (
            "Sort these numbers from smallest to largest:",
            "Sort these numbers:",
            "Put these numbers in order:",
        )
    )
    answer = " ".join(map(str, sorted(numbers)))
    return Example("sort", f"{intro} {' '.join(map(str, numbers))}", answer)


def add_numbers(rng: random.Random) -> Example:
    a, b = rng.randrange(100), rng.randrange(100)
    prompt = rng.choice((f"What is {a} + {b}?", f"Add {a} and {b}.", f"{a} + {b} ="))
    return Example("add", prompt, str(a + b))


def subtract_numbers(rng: random.Random) -> Example:
    a = rng.randrange(100)
    b = rng.randrange(a + 1)  # answers stay non-negative
    prompt = rng.choice((f"What is {a} - {b}?", f"Subtract {b} from {a}.", f"{a} - {b} ="))
    return Example("subtract", prompt, str(a - b))


def count_items(rng: random.Random) -> Example:
    items = _phrase(rng, NOUNS, 1, 9)
    listing = ", ".join(items)
    prompt = rng.choice(
        (
            f"How many items are in this list? {listing}",
            f"Count the items: {listing}",
            f"How many words are here? {listing}",
        )
    )
    return Example("count", prompt, str(len(items)))


def change_case(rng: random.Random) -> Example:
    text = " ".join(_phrase(rng, NOUNS + COLORS, 2, 5))
    if rng.random() < 0.5:
        intro = rng.choice(("Write this in capital letters:", "Make this upper case:"))
        return Example("case", f"{intro} {text}", text.upper())
    intro = rng.choice(("Write this in small letters:", "Make this lower case:"))
    return Example("case", f"{intro} {text.upper()}", text)


_KEY_SYLLABLES = words(
    "ka|ro|mi|len|dor|tha|vel|qui|ster|bel|cor|dra|fen|gal|hin|jo|kel|lum|mor|nes|pra|rin"
    "|sol|tor|vin|wex|yar|zen|bra|chi"
)
# Made-up names as lookup keys: the model can't know them, so it must find them in the context.
LOOKUP_KEYS = tuple(sorted({(a + b).capitalize() for a in _KEY_SYLLABLES for b in _KEY_SYLLABLES}))


def lookup_value(rng: random.Random) -> Example:
    num_pairs = rng.randint(3, 20) if rng.random() < 0.85 else rng.randint(21, 110)
    keys = rng.sample(LOOKUP_KEYS, num_pairs)
    values = [rng.randrange(100, 1000) for _ in keys]
    # "- Key: value" lines: the key follows a space, so it tokenizes as in the question. The
    # reply quotes the whole line: once it has written "- Key:", finding the value is plain
    # copying (induction), which a small model learns far sooner than a lookup to a bare value.
    lines = [f"- {k}: {v}" for k, v in zip(keys, values)]
    table = "\n".join(lines)
    index = rng.randrange(num_pairs)
    question = rng.choice(
        (f"What is the code for {keys[index]}?", f"Which number belongs to {keys[index]}?")
    )
    prompt = f"Here is a list of codes.\n{table}\n{question}"
    return Example("lookup", prompt, lines[index])


def continue_pattern(rng: random.Random) -> Example:
    shown = rng.randint(4, 7)
    if rng.random() < 0.5:
        start, step = rng.randrange(30), rng.randint(1, 9)
        items = [str(start + step * i) for i in range(shown + 3)]
    else:
        pool = rng.choice((COLORS, SHAPES, NOUNS))
        cycle = rng.sample(pool, rng.randint(2, 3))
        items = [cycle[i % len(cycle)] for i in range(shown + 3)]
    intro = rng.choice(("Continue the pattern:", "What comes next?"))
    return Example("pattern", f"{intro} {' '.join(items[:shown])}", " ".join(items[shown:]))


_GREETINGS = words("Hello!|Hi!|Hello.|Hi there.|Hey!|Good morning!|Who are you?|What can you do?")
_HELP = (
    "Hello! I am a tiny demo model. I can repeat text, reverse a list of words, sort numbers, "
    "add and subtract small numbers, count items, change case, find a code in a list, "
    "continue a pattern and tell short stories."
)


def greeting(rng: random.Random) -> Example:
    """Teaches the model to say what it can do when a newcomer says hello."""
    return Example("greeting", rng.choice(_GREETINGS), _HELP)


def story_chat(rng: random.Random) -> Example:
    prompt, text = story_request(rng)
    return Example("story_chat", prompt, text)


def story_text(rng: random.Random) -> Example:
    return Example("story", None, story(rng))


# Short tasks asked with tools offered (`tool_tasks`) that none of them serves: the model
# answers these itself, so it learns to call `multiply` for a multiplication only.
_TOOL_FREE_TASKS = ("copy", "reverse", "sort", "add", "subtract", "count", "case", "pattern")


def tools_unused(rng: random.Random) -> Example:
    example = CHECKABLE_TASKS[rng.choice(_TOOL_FREE_TASKS)](rng)
    return dataclasses.replace(example, task="tools_unused", tools=offered_tools(rng)[0])


# Tasks with one right answer: the ones `tokenmill eval` scores, by exact match.
CHECKABLE_TASKS: dict[str, Callable[[random.Random], Example]] = {
    "copy": copy_passage,
    "reverse": reverse_words,
    "sort": sort_numbers,
    "add": add_numbers,
    "subtract": subtract_numbers,
    "count": count_items,
    "case": change_case,
    "lookup": lookup_value,
    "pattern": continue_pattern,
    "tool_call": tool_call,  # tool_tasks.py: a multiplication, with tools offered
    "tool_answer": tool_answer,  # and the reply once the tool's result is in
}

ALL_TASKS: dict[str, Callable[[random.Random], Example]] = {
    **CHECKABLE_TASKS,
    "copy_words": copy_words,  # scored as "copy"; the training curriculum starts with it
    "greeting": greeting,
    "story_chat": story_chat,
    "story": story_text,
    "tools_unused": tools_unused,
}
