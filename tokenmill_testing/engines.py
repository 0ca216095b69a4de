"""The offline engine the tests build on a test checkpoint: one recipe, so that every test
module's engine differs from the others only in the settings its test is about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill import LLM

# float32: outputs compare token for token across engines, features and runs; a short context:
# few KV blocks to size and allocate. A test's own settings win over these.
TEST_ENGINE_SETTINGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 96}


def make_llm(checkpoint: str | Path, **settings: Any) -> LLM:
    """An `LLM` on `checkpoint` with `TEST_ENGINE_SETTINGS` under `settings` (`LLM`'s
    keyword arguments)."""
    return LLM(model=str(checkpoint), **{**TEST_ENGINE_SETTINGS, **settings})
