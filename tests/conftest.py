"""Shared fixtures: small random Hugging Face checkpoints, built once per test session."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The policy tokenmill's own processes run under (tokenmill/openmp.py), set here because torch is
# imported before tokenmill: the test process's idle OpenMP threads sleep instead of spinning
# against the servers and workers it starts on the same two cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

if not torch.cuda.is_available():
    # The Triton attention kernel's tests run it on CPU tensors under Triton's interpreter,
    # which must be on before triton is first imported: by whichever module imports it first
    # when the whole suite is collected, not only by those tests' own modules.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenmill_testing.random_checkpoint import save_random_checkpoint, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]

# Two tiers: `pytest -m "not slow"` (the fast tier, a few minutes on 2 cores: what a developer
# runs after each edit) and plain `pytest` (everything: what CI runs). A test is slow when it
# or a fixture it uses starts a process (calls one of PROCESS_STARTERS: servers, routers, the
# hosts of a disaggregated pair, CLI subprocesses), when its module is listed below, when it
# runs a native kernel at an ISA level below this CPU's best (the fast tier runs the level the
# CPU runs; the full tier every level), or when it is marked `@pytest.mark.slow` itself.
PROCESS_STARTERS = (
    "start_server(",
    "start_router(",
    "ServerProcess(",
    "two_hosts(",
    "subprocess.run(",
    "subprocess.Popen(",
)
SLOW_MODULES = {
    "tests/model/test_captured_decode.py": "traces and compiles decode steps (torch.compile)",
    "tests/model/test_tensor_parallel.py": "starts tensor-parallel worker processes",
    "tests/model/test_tensor_parallel_failures.py": "starts and kills tensor-parallel workers",
    "tests/model/test_pipeline_parallel.py": "starts pipeline-parallel worker processes",
    "tests/model/test_quantization_checkpoints.py": "each pre-quantized format through a whole "
    "engine, against its float model",
    "tests/bench/test_vs_peers.py": "the peer harness: servers, llama.cpp, offline batches",
    "tests/bench/test_itl_serving.py": "benchmark runs against a started `tokenmill serve`",
    "tests/bench/test_perplexity_vs_llamacpp.py": "perplexity through the engine and llama.cpp",
}


def slow_reason(item: pytest.Item) -> str | None:
    """Why `item` belongs to the full tier only, or None for the fast tier."""
    for name, function in functions_run(item):
        starter = process_starter(function)
        if starter is not None:
            return f"starts a process (`{name}` calls `{starter}`)"
    module = item.path.relative_to(ROOT).as_posix()
    if module in SLOW_MODULES:
        return SLOW_MODULES[module]
    if below_best_isa(item):
        return "a native kernel at an ISA level below this CPU's best"
    return None


def functions_run(item: pytest.Item) -> list[tuple[str, Callable[..., Any]]]:
    """The test function and every fixture function it uses (directly or through others)."""
    functions = [(item.name, item.function)] if isinstance(item, pytest.Function) else []
    definitions = getattr(item, "_fixtureinfo", None)
    for name, fixturedefs in definitions.name2fixturedefs.items() if definitions else ():
        functions.append((name, fixturedefs[-1].func))
    return functions


@functools.cache
def process_starter(function: Callable[..., Any]) -> str | None:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    return next((starter for starter in PROCESS_STARTERS if starter in source), None)


def below_best_isa(item: pytest.Item) -> bool:
    """A kernel test parametrized by the `isa` fixture, at a level under the highest it runs."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "isa" not in callspec.params:
        return False
    return callspec.params["isa"] < max(isa_levels())


@functools.cache
def isa_levels() -> tuple[int, ...]:
    """Every kernel ISA level this CPU runs (none where the native kernels don't build)."""
    from tokenmill.kernels import native

    module = native.native_kernels()
    return tuple(range(module.detect_isa() + 1)) if module is not None else ()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that asks for `isa` runs once per level (below the best only in the full tier)."""
    if "isa" in metafunc.fixturenames:
        from tokenmill.kernels.native import ISA_LEVELS

        levels = isa_levels()
        metafunc.parametrize(
            "isa", levels, indirect=True, ids=[ISA_LEVELS[level] for level in levels]
        )


@pytest.fixture
def isa(request: pytest.FixtureRequest) -> Iterator[int]:
    """The native kernels forced to one ISA level for the test, restored after it."""
    from tokenmill.kernels import native

    with native.using_isa(request.param) as level:
        assert level == request.param
        yield level


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None:
            reason = slow_reason(item)
            if reason is not None:
                item.add_marker(pytest.mark.slow(reason=reason))


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


@pytest.fixture(scope="session")
def pooling_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[..., Path]:
    """Factory `pooling_checkpoint(builder, **kwargs) -> Path`, cached by its arguments:
    builder "sentence_transformer", "cross_encoder" or "yes_no_reranker" of
    tokenmill_testing/pooling_checkpoints.py (Qwen3 ones use the session tokenizer). Treat
    the directory as read-only."""
    from tokenmill_testing import pooling_checkpoints

    cache: dict[str, Path] = {}

    def build(builder: str, **kwargs: Any) -> Path:
        key = repr((builder, sorted(kwargs.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"pooling-{builder}") / "model"
            if builder == "yes_no_reranker" or (
                builder == "sentence_transformer" and kwargs.get("kind") == "qwen3"
            ):
                kwargs = {**kwargs, "tokenizer_dir": tokenizer_dir}
            cache[key] = getattr(pooling_checkpoints, f"save_{builder}")(path, **kwargs)
        return cache[key]

    return build


@pytest.fixture(params=["float", "int8"], ids=lambda path: f"{path}-activations")
def activation_tolerance(request: pytest.FixtureRequest):
    """Runs the test with the quantized kernels' float or int8 (AVX2 / VNNI) activations; the
    value is that path's |logprob - reference| tolerance. Skips a path this CPU cannot run (and
    the float one where only the portable kernels have it)."""
    from tokenmill_testing.quantized_checkpoints import (
        Unavailable,
        activation_path,
        float_path_is_only_portable,
    )

    if request.param == "float" and float_path_is_only_portable():
        pytest.skip("float activations run only the portable kernels on this CPU")
    try:
        with activation_path(request.param) as tolerance:
            yield tolerance
    except Unavailable as reason:
        pytest.skip(str(reason))
