"""Shared fixtures: small random Hugging Face checkpoints, built once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton attention kernel's tests run it on CPU tensors under Triton's interpreter,
    # which must be on before triton is first imported: by whichever module imports it first
    # when the whole suite is collected, not only by those tests' own modules.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill_testing.random_checkpoint import save_random_checkpoint, train_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One trained tokenizer (vocab 1024) shared by every checkpoint of the session."""
    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[..., Path]:
    """Factory `tiny_checkpoint(architecture, **kwargs) -> Path`, cached by its arguments.

    kwargs are those of `save_random_checkpoint`; the session tokenizer is used unless a
    `tokenizer_dir` is given. Treat the returned directory as read-only: it is shared.
    """
    cache: dict[str, Path] = {}

    def build(architecture: str, **kwargs: Any) -> Path:
        kwargs.setdefault("tokenizer_dir", tokenizer_dir)
        key = repr((architecture, sorted(kwargs.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{architecture}")
            cache[key] = save_random_checkpoint(path, architecture, **kwargs)
        return cache[key]

    return build


@pytest.fixture(params=["float", "int8"], ids=lambda path: f"{path}-activations")
def activation_tolerance(request: pytest.FixtureRequest):
    """Runs the test with the quantized kernels' float or int8 (VNNI) activations; the value
    is that path's |logprob - reference| tolerance. Skips a path this CPU cannot run."""
    from tokenmill_testing.quantized_checkpoints import Unavailable, activation_path

    try:
        with activation_path(request.param) as tolerance:
            yield tolerance
    except Unavailable as reason:
        pytest.skip(str(reason))
