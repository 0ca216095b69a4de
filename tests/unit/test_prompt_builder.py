"""The server's prompt checks (entrypoints/http/openai/inputs.py), without a server."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tokenmill.entrypoints.http.openai.inputs import PromptBuilder


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_log() -> Iterator[list[str]]:
    """What transformers logs (its loggers do not propagate to the root logger)."""
    recorder = Recorder()
    logger = logging.getLogger("transformers")
    logger.addHandler(recorder)
    try:
        yield recorder.messages
    finally:
        logger.removeHandler(recorder)


def test_a_prompt_longer_than_the_context_is_encoded_without_transformers_warning(
    tokenizer_dir: Path, transformers_log: list[str]
) -> None:
    """The server refuses it itself (a 400 by max_tokens' rule, or the engine's intake);
    transformers' "Token indices sequence length is longer than the specified maximum" line
    would only be noise in its log."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)  # fresh: the warning is one-shot
    tokenizer.model_max_length = 8
    prompts = PromptBuilder(tokenizer, len(tokenizer), max_model_len=8)
    [prompt] = prompts.completion_prompts("the quick brown fox jumps over the lazy dog " * 4, True)
    assert len(prompt.token_ids) > 8
    assert not any("Token indices sequence length" in m for m in transformers_log)
