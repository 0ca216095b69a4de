"""What one request's constraint may cost: whitespace bounded by default (JSON at temperature 1
stays valid), schema size and nesting bounded, compiles that time out, are cancelled when
nobody waits, run on two lanes, fit a byte budget, and stop with the engine."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError, StructuredOutputsConfig
from tokenmill.sampling_params import InvalidRequestError, StructuredOutputsParams
from tokenmill.structured_output import backend
from tokenmill.structured_output.manager import SMALL_CONSTRAINT_BYTES, StructuredOutputManager

PROMPT = "Reverse this list: apple banana cherry"
# Every field bounded, as in the measurement (1 of 40 replies parsed before).
BOUNDED = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "s": {"type": "string", "maxLength": 4},
        "e": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["ok", "n", "s", "e"],
    "additionalProperties": False,
}
# The README's offline example.
README_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
}


# ---- whitespace ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["random", "demo"])
@pytest.mark.slow(reason="many sampled completions")
def test_json_at_temperature_1_is_valid_with_the_default_whitespace(which, request) -> None:
    """No disable_any_whitespace: before, the grammar let the model pad with spaces and
    newlines until max_tokens."""
    llm: LLM = request.getfixturevalue(f"{which}_llm")
    params = [
        SamplingParams(
            temperature=1.0, seed=seed, n=8, max_tokens=96, structured_outputs={"json": BOUNDED}
        )
        for seed in range(4)
    ]
    for output in llm.generate([PROMPT] * len(params), params, use_tqdm=False):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), BOUNDED)


def test_the_readme_example_prints_a_valid_object(demo_llm: LLM) -> None:
    """README.md's offline example (sampling's defaults: temperature 1) at ten seeds."""
    for seed in range(10):
        params = SamplingParams(
            structured_outputs={"json": README_SCHEMA}, max_tokens=32, seed=seed
        )
        text = demo_llm.generate(["Add 2 and 3"], params, use_tqdm=False)[0].outputs[0].text
        jsonschema.validate(json.loads(text), README_SCHEMA)


def _accepts(xgrammar_backend: backend.XgrammarBackend, text: str, **kind) -> bool:
    compiled = xgrammar_backend.compile(StructuredOutputsParams(**kind))
    return xgrammar_backend.matcher(compiled, []).accept_string(text)


def test_whitespace_between_json_tokens_is_bounded_unless_freed(random_llm: LLM) -> None:
    engine = random_llm.engine
    args = (engine.tokenizer, engine.vocab_size, engine.parts.eos_token_ids)
    bounded = backend.XgrammarBackend(*args)  # the default: StructuredOutputsConfig's
    free = backend.XgrammarBackend(*args, max_whitespace=None)
    assert _accepts(bounded, '{ "answer": 1', json=README_SCHEMA)
    assert not _accepts(bounded, '{  "answer"', json=README_SCHEMA)
    assert not _accepts(bounded, '{"answer":' + "\n" * 2, json=README_SCHEMA)
    assert _accepts(free, "{" + " " * 40 + '"answer":\n\n\n 1', json=README_SCHEMA)
    # disable_any_whitespace still leaves only ", " and ": "
    assert not _accepts(bounded, '{ "answer"', json=README_SCHEMA, disable_any_whitespace=True)


def test_the_server_wide_switches_reach_the_grammar(tiny_checkpoint) -> None:
    config = {"max_whitespace": None, "disable_any_whitespace": True}
    llm = LLM(model=str(tiny_checkpoint("llama")), structured_outputs_config=config)
    manager = llm.engine.parts.structured_output
    assert manager.config == StructuredOutputsConfig(
        max_whitespace=None, disable_any_whitespace=True
    )
    compiled, release = manager.hold(StructuredOutputsParams(json=README_SCHEMA))
    matcher = manager._backend.result().matcher(compiled.result(), [])
    assert not matcher.accept_string("{ ")  # every request compact, as if it asked
    release()


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"max_whitespace": 0}', "max_whitespace"),
        ('{"max_schema_bytes": -1}', "max_schema_bytes"),
        ('{"compile_timeout": 0}', "compile_timeout"),
        ('{"backend": "outlines"}', "backend"),
        ('{"whitespace": 1}', "unknown"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_structured_outputs_config_is_one_clear_error(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StructuredOutputsConfig.parse(value)


# ---- what a request may ask ---------------------------------------------------------------


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_schema_nesting_is_bounded_before_any_recursive_check(random_llm: LLM) -> None:
    random_llm.engine.parts.structured_output.validate(StructuredOutputsParams(json=nested(30)))
    for depth in (40, 160, 400):  # 160 and more: a RecursionError in the check before
        with pytest.raises(InvalidRequestError, match="levels deep") as error:
            StructuredOutputsParams(json=nested(depth), param="guided_json")
        assert error.value.param == "guided_json"
    as_text = '{"properties": {"a": ' * 2000 + "{}" + "}}" * 2000  # json.loads recurses
    with pytest.raises(InvalidRequestError, match="levels deep"):
        StructuredOutputsParams(json=as_text)


def test_vllm_options_are_accepted_or_refused_by_name() -> None:
    accepted = {"disable_fallback": True, "disable_additional_properties": True}
    SamplingParams(structured_outputs={"regex": "a", **accepted})
    for key, value in (("whitespace_pattern", " "), ("structural_tag", "{}"), ("backend", "x")):
        with pytest.raises(InvalidRequestError) as error:
            SamplingParams(structured_outputs={"regex": "a", key: value})
        assert error.value.param == f"structured_outputs.{key}"


def test_schema_size_is_bounded(tiny_checkpoint) -> None:
    config = {"max_schema_bytes": 300}
    llm = LLM(model=str(tiny_checkpoint("llama")), structured_outputs_config=config)
    small = SamplingParams(max_tokens=4, structured_outputs={"regex": "[ab]{1,3}"})
    large = SamplingParams(structured_outputs={"choice": [f"{i}" + "x" * 50 for i in range(7)]})
    assert llm.generate([PROMPT], small, use_tqdm=False)[0].outputs[0].finish_reason == "stop"
    with pytest.raises(InvalidRequestError, match="max_schema_bytes"):
        llm.generate([PROMPT], large, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---- compiles -----------------------------------------------------------------------------


@pytest.fixture
def blocked_compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Compiles of regexes starting with "slow" wait until the event is set."""
    release = threading.Event()
    real = StructuredOutputManager._compile

    def compile(self, params: StructuredOutputsParams):
        if (params.regex or "").startswith("slow"):
            assert release.wait(30), "the test never released the compile"
        return real(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", compile)
    yield release
    release.set()


def wait_running(future: Future) -> None:
    """Until a compile thread has picked `future` up (behind the tokenizer's table)."""
    done = threading.Event()
    while not (future.running() or future.done()):
        done.wait(0.01)


def manager_of(tiny_checkpoint, **config) -> StructuredOutputManager:
    llm = LLM(model=str(tiny_checkpoint("llama")), structured_outputs_config=config)
    return llm.engine.parts.structured_output


def test_a_compile_past_its_timeout_ends_the_request_with_the_reason(
    tiny_checkpoint, blocked_compiles
) -> None:
    llm = LLM(
        model=str(tiny_checkpoint("llama")), structured_outputs_config={"compile_timeout": 0.2}
    )
    params = [SamplingParams(max_tokens=4, structured_outputs={"regex": r"slow\d"})]
    params.append(SamplingParams(max_tokens=4, temperature=0))
    slow, free = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    assert slow.outputs[0].finish_reason == "error"
    assert "did not compile within 0.2 s" in str(slow.outputs[0].stop_reason)
    assert free.outputs[0].finish_reason == "length"


def test_a_small_constraint_never_waits_behind_a_large_compile(
    tiny_checkpoint, blocked_compiles
) -> None:
    manager = manager_of(tiny_checkpoint)
    large = StructuredOutputsParams(regex="slow" + "a" * SMALL_CONSTRAINT_BYTES)
    large_compile, release_large = manager.hold(large)
    small_compile, release_small = manager.hold(StructuredOutputsParams(regex="[ab]{3}"))
    small_compile.result(timeout=30)  # before the lane fix: queued behind the large one
    assert not large_compile.done()
    blocked_compiles.set()
    large_compile.result(timeout=30)
    release_large(), release_small()


def test_a_compile_nobody_waits_for_is_cancelled(tiny_checkpoint, blocked_compiles) -> None:
    """Its request aborted while the compile still queued: it never runs, nor stays cached."""
    llm = LLM(model=str(tiny_checkpoint("llama")))
    engine, manager = llm.engine, llm.engine.parts.structured_output
    running, release_running = manager.hold(StructuredOutputsParams(regex="slow1"))
    wait_running(running)
    engine.add_request("gone", PROMPT, SamplingParams(structured_outputs={"regex": "slow2"}))
    engine.step()  # nothing to run: "gone" waits for its compile
    queued = engine.scheduler.requests["gone"].grammar._compiled
    assert not queued.done() and manager.num_cached_grammars == 2
    engine.abort_request("gone")
    assert queued.cancelled() and manager.num_cached_grammars == 1
    release_running()  # a running compile cannot be stopped: it finishes and stays cached
    blocked_compiles.set()
    running.result(timeout=30)
    assert manager.num_cached_grammars == 1


def test_the_grammar_cache_is_capped_by_bytes(tiny_checkpoint) -> None:
    first = StructuredOutputsParams(json=BOUNDED)
    probe = manager_of(tiny_checkpoint)
    compiled, release = probe.hold(first)
    one_grammar = compiled.result(timeout=60).memory_size_bytes
    release()
    manager = manager_of(tiny_checkpoint, cache_max_bytes=int(one_grammar * 2.5))
    for i in range(6):  # six distinct grammars about the size of the first
        schema = {**BOUNDED, "properties": {**BOUNDED["properties"], f"x{i}": {"type": "null"}}}
        compiled, release = manager.hold(StructuredOutputsParams(json=schema))
        compiled.result(timeout=60)
        release()
        assert manager.cached_grammar_bytes <= int(one_grammar * 2.5)
    assert 1 <= manager.num_cached_grammars <= 2


def test_engine_shutdown_stops_the_compile_threads(tiny_checkpoint, blocked_compiles) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")))
    manager = llm.engine.parts.structured_output
    running, _ = manager.hold(StructuredOutputsParams(regex="slow1"))
    wait_running(running)
    queued, _ = manager.hold(StructuredOutputsParams(regex="slow2"))
    llm.engine.shutdown()
    assert queued.cancelled()
    assert all(executor._shutdown for executor in manager._executors.values())
    blocked_compiles.set()
    assert isinstance(running, Future) and running.result(timeout=30) is not None


def test_the_flag_takes_vllms_name_and_json() -> None:
    import argparse

    from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--structured-outputs-config", '{"max_whitespace": null}'])
    config = engine_config_from_args(args).structured_outputs_config
    assert config == StructuredOutputsConfig(max_whitespace=None)
