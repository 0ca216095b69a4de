"""Engines the model tests share: built once per test module that asks for them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill import LLM
from tokenmill_testing.engines import make_llm


@pytest.fixture(scope="module")
def random_llm(tiny_checkpoint: Callable[..., Path]) -> LLM:
    """The random Llama checkpoint's engine, with room for 256 positions."""
    return make_llm(tiny_checkpoint("llama"), max_model_len=256)


@pytest.fixture(scope="module")
def demo_llm() -> LLM:
    """The built-in demo target's engine, as `LLM()` makes it."""
    return LLM()
