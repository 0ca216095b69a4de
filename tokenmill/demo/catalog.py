"""What the built-in models are and what to ask them: the text of `tokenmill models`."""

from __future__ import annotations

import json
import shlex

from tokenmill.demo import DEMO_MODEL_NAMES, WEIGHTS_DIR

# Prompts that show each skill, with the demo target's reply (checked by tests/demo, greedy;
# chosen so that its default temperature 0.2 gives the same); None: open-ended.
EXAMPLES: dict[str, str | None] = {
    "Reverse this list: apple banana cherry dog": "dog cherry banana apple",
    "What is 23 + 58?": "81",
    "What is 71 - 25?": "46",
    "Sort these numbers: 31 5 77 12": "5 12 31 77",
    "Count the items: cup, pen, book, lamp, key": "5",
    "Make this upper case: red apple": "RED APPLE",
    "Continue the pattern: 5 10 15 20": "25 30 35",
    "Repeat this text exactly:\nOnce upon a time, there was a little fox named Max.": (
        "Once upon a time, there was a little fox named Max."
    ),
    "Here is a list of codes.\n- Velqui: 163\n- Dracor: 729\n- Fenjo: 450\n"
    "Which number belongs to Dracor?": "- Dracor: 729",
    "Tell me a story about a dog.": None,
    "Hello!": None,
}

EXAMPLE_COMMAND = "tokenmill generate --chat --prompt"

SKILLS = (
    "chat (ChatML): repeat a passage, reverse a list of words, sort numbers below 100, "
    "add or subtract numbers below 100, count up to 9 items, change case, find the code "
    "for a name in a list of up to ~110 entries (~1000 tokens), continue a number or word "
    "pattern, tell a short story; plain completion: continue a story"
)

VOCABULARY = (
    "the words of its corpus only: simple English stories (children, animals, places, "
    "feelings), the task instructions above, everyday nouns (apple, cat, cup, ...), colours, "
    "shapes and numbers. Its 2048-token byte-level BPE encodes any text, but other words "
    "are split into pieces it has never seen used, and its replies to them are noise"
)


def _summary(name: str) -> str:
    path = WEIGHTS_DIR / name
    info_file = path / "tokenmill_demo.json"
    if not info_file.is_file():
        return f"  {name}: missing (python -m demo_training.train --model {name})"
    info = json.loads(info_file.read_text())
    size_mb = sum(p.stat().st_size for p in path.iterdir()) / 1e6
    return (
        f"  {info['name']}  ({name}, {info['num_parameters'] / 1e6:.1f}M parameters, "
        f"{size_mb:.0f} MB)\n    {info['description']}\n    {path}"
    )


def describe_models() -> str:
    lines = ["Built-in models (trained here on a synthetic corpus; see docs/demo_models.md):"]
    lines += [_summary(name) for name in DEMO_MODEL_NAMES]
    lines += [
        "",
        f"What the demo target can do: {SKILLS}.",
        f"What it knows: {VOCABULARY}.",
        "",
        "Try these (each pastes into a shell as it is; # -> the expected reply):",
        *(_example_command(prompt, reply) for prompt, reply in EXAMPLES.items()),
        "",
        "Measure it: tokenmill eval  (exact-match accuracy per task, on held-out prompts)",
    ]
    return "\n".join(lines)


def _example_command(prompt: str, reply: str | None) -> str:
    """A command a shell runs as printed: the prompt quoted by `shlex.quote` (a newline stays
    a real newline inside single quotes, where `\\n` would stay two characters), the expected
    reply as a comment. Not indented: a multi-line prompt's next line is part of it."""
    command = f"{EXAMPLE_COMMAND} {shlex.quote(prompt)}"
    return command if reply is None else f"{command}  # -> {json.dumps(reply)}"
