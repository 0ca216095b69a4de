"""What the built-in models are and what to ask them: the text of `tokenmill models`."""

from __future__ import annotations

import json

from tokenmill.demo import DEMO_MODEL_NAMES, WEIGHTS_DIR

# Prompts that show each skill; docs/demo_models.md lists the target's real replies.
EXAMPLE_PROMPTS: tuple[str, ...] = (
    "Reverse this list: apple banana cherry dog",
    "What is 23 + 58?",
    "What is 71 - 25?",
    "Sort these numbers: 42 7 19 3 88",
    "Count the items: cup, pen, book, lamp, key",
    "Make this upper case: red apple",
    "Continue the pattern: 5 10 15 20",
    "Repeat this text exactly:\nOnce upon a time, there was a little fox named Max.",
    "Here is a list of codes.\n- Tormi: 311\n- Kelsol: 845\n- Dravin: 207\n"
    "What is the code for Kelsol?",
    "Tell me a story about a dog.",
    "Hello!",
)

SKILLS = (
    "chat (ChatML): repeat a passage, reverse a list of words, sort numbers below 100, "
    "add or subtract numbers below 100, count up to 9 items, change case, find the code "
    "for a name in a list of up to ~110 entries (~1000 tokens), continue a number or word "
    "pattern, tell a short story; plain completion: continue a story"
)


def _summary(name: str) -> str:
    path = WEIGHTS_DIR / name
    info_file = path / "tokenmill_demo.json"
    if not info_file.is_file():
        return f"  {name}: missing (python -m tokenmill.demo.train --model {name})"
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
        "",
        "Try (tokenmill generate --chat --prompt '...'):",
        *(f"  {json.dumps(p)}" for p in EXAMPLE_PROMPTS),
        "",
        "Measure it: tokenmill eval  (exact-match accuracy per task, on held-out prompts)",
    ]
    return "\n".join(lines)
