"""Real text with an exact token count for a given tokenizer.

Benchmark prompts must be text (servers tokenize them) yet have exactly the length the
dataset asks for, or the input-length axis of every result is wrong. Random token ids decoded
to text do not survive re-tokenization, so we write English-like prose from a seeded RNG and
cut it at token boundaries, re-counting until the tokenizer agrees.

A prompt's length is counted as the server counts a `/v1/completions` prompt: the tokenizer's
`input_ids` with its special tokens (a BOS, for most models).
"""

from __future__ import annotations

import random
from typing import Protocol

_SUBJECTS = (
    "the engineer", "a small team", "our scheduler", "the old library", "every student",
    "the committee", "a curious child", "the river", "my neighbour", "the new manager",
    "the orchestra", "a tired traveller", "the city council", "this machine", "the captain",
    "a young scientist", "the kitchen staff", "the research group", "her brother", "the pilot",
)  # fmt: skip
_VERBS = (
    "reads", "builds", "explains", "measures", "repairs", "describes", "remembers", "visits",
    "questions", "organizes", "delivers", "considers", "collects", "protects", "imagines",
    "discovers", "follows", "paints", "answers", "studies",
)  # fmt: skip
_OBJECTS = (
    "a long letter", "the quarterly report", "an ancient map", "the mountain road",
    "a difficult problem", "the evening news", "the wooden bridge", "several bright stars",
    "a forgotten song", "the network protocol", "an interesting theory", "the garden fence",
    "a large database", "the weather forecast", "the summer festival", "a handwritten recipe",
    "the history lesson", "a heavy suitcase", "the train timetable", "a new proposal",
)  # fmt: skip
_ADVERBIALS = (
    "in the morning", "after dinner", "without hesitation", "very carefully", "every week",
    "during the storm", "before sunrise", "with great patience", "near the station",
    "at the university", "once again", "for no clear reason", "on Tuesday", "in December",
    "across the valley", "behind the house", "as quickly as possible", "late at night",
)  # fmt: skip
_CONNECTIVES = ("and then", "but", "because", "although", "while", "so", "until", "whereas")


class Tokenizer(Protocol):
    """The slice of a Hugging Face fast tokenizer the datasets use."""

    all_special_ids: list[int]

    def __call__(self, text: str, **kwargs: object) -> dict: ...

    def decode(self, ids: list[int]) -> str: ...

    def __len__(self) -> int: ...


def sentence(rng: random.Random) -> str:
    """One plausible English sentence."""
    s, v, o, a = (rng.choice(x) for x in (_SUBJECTS, _VERBS, _OBJECTS, _ADVERBIALS))
    if rng.random() < 0.4:
        clause = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        text = f"{s} {v} {o} {a}, {rng.choice(_CONNECTIVES)} {clause}."
    else:
        text = f"{s} {v} {o} {a}."
    return text[0].upper() + text[1:]


def prose(rng: random.Random, num_sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(num_sentences))


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Tokens a server computes for `text` as a completions prompt (special tokens included)."""
    return len(tokenizer(text, verbose=False)["input_ids"])


def fit_text(
    tokenizer: Tokenizer,
    rng: random.Random,
    num_tokens: int,
    head: str = "",
    tail: str = "",
    max_rounds: int = 64,
) -> str:
    """`head + body + tail` with exactly `num_tokens` tokens, `body` being generated prose.

    `head` and `tail` are kept verbatim (a shared system prompt stays byte-identical, so its
    tokens are identical and prefix caching can find them). Raises ValueError if they alone
    already exceed `num_tokens`, or if no cut converges (a tokenizer that merges across
    every boundary, not seen in practice).
    """
    fixed = count_tokens(tokenizer, head + tail)
    if fixed > num_tokens:
        raise ValueError(f"cannot fit {num_tokens} tokens: the fixed text alone has {fixed} tokens")
    body = ""
    for _ in range(max_rounds):
        have = count_tokens(tokenizer, head + body + tail)
        if have == num_tokens:
            return head + body + tail
        if have < num_tokens:
            body = _grow(rng, body, num_tokens - have)
        else:
            body = _cut(tokenizer, head, body, have - num_tokens)
    raise ValueError(f"could not fit text to exactly {num_tokens} tokens")


def _grow(rng: random.Random, body: str, deficit: int) -> str:
    """Add roughly `deficit` tokens of prose; a one-word step when one token is missing,
    so that the cut that follows (if any) has little to undo."""
    if deficit <= 2:
        addition = rng.choice(("the", "a", "and", "so", "of", "it"))
    else:
        addition = prose(rng, max(1, deficit // 12 + 1))
    return f"{body} {addition}" if body else addition


def _cut(tokenizer: Tokenizer, head: str, body: str, excess: int) -> str:
    """Drop the last `excess` tokens of `body`, cutting at a token boundary of `head + body`.

    A tokenizer without offsets (a server's /tokenize) cuts by decoding the tokens kept."""
    encoded = tokenizer(
        head + body, add_special_tokens=False, return_offsets_mapping=True, verbose=False
    )
    if "offset_mapping" not in encoded:
        ids = encoded["input_ids"]
        kept = tokenizer.decode(ids[: max(len(ids) - excess, 0)])
        return kept[len(head) :].rstrip() if kept.startswith(head) else ""
    ends = [end for _, end in encoded["offset_mapping"] if end > len(head)]
    keep = len(ends) - excess
    if keep <= 0:
        return ""
    return (head + body)[len(head) : ends[keep - 1]].rstrip()
