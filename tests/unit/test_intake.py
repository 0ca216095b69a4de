"""The engine's one intake (engine/intake.py): what it refuses, what it resolves, and that the
caller's sampling parameters come back untouched."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tokenmill.config import StructuredOutputsConfig
from tokenmill.engine.intake import EngineRequest, PromptTooLongError, RequestIntake, sample_id
from tokenmill.sampling_params import InvalidRequestError, RequestOutputKind, SamplingParams
from tokenmill.structured_output.manager import StructuredOutputManager

VOCAB = 100_000  # more than the test tokenizer has
MAX_MODEL_LEN = 16
EOS = {2}


@pytest.fixture
def intake(tokenizer_dir: Path) -> RequestIntake:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    grammars = StructuredOutputManager(tokenizer, len(tokenizer), EOS, StructuredOutputsConfig())
    return RequestIntake(tokenizer, VOCAB, MAX_MODEL_LEN, EOS, grammars)


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], SamplingParams(), "prompt"),
        ([1, VOCAB], SamplingParams(), "prompt"),
        ([1] * (MAX_MODEL_LEN + 1), SamplingParams(), "prompt"),
        ([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
        ([1, 2], SamplingParams(stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
        ([1, 2], SamplingParams(structured_outputs={"regex": "("}), "structured_outputs"),
        ({"not": "a prompt"}, SamplingParams(), "prompt"),
    ],
    ids=["empty", "out-of-vocab", "too-long", "logit-bias", "stop-token", "regex", "not-a-prompt"],
)
def test_what_the_engine_cannot_take_is_refused_naming_the_field(
    intake: RequestIntake, prompt: object, params: SamplingParams, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        intake.resolve(EngineRequest("r", prompt, params))  # type: ignore[arg-type]
    assert refused.value.param == param


def test_a_prompt_longer_than_the_context_says_by_how_much(intake: RequestIntake) -> None:
    with pytest.raises(PromptTooLongError) as refused:
        intake.resolve(EngineRequest("r", [1] * 20, SamplingParams()))
    assert (refused.value.num_tokens, refused.value.max_model_len) == (20, MAX_MODEL_LEN)


@pytest.mark.parametrize("salt", ["", "\ud800"])
def test_a_bad_cache_salt_is_refused(intake: RequestIntake, salt: str) -> None:
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        intake.resolve(EngineRequest("r", [1, 2], SamplingParams(), cache_salt=salt))


def test_max_tokens_is_resolved_within_the_context(intake: RequestIntake) -> None:
    for asked, resolved in [(None, 6), (100, 6), (3, 3)]:
        request = EngineRequest("r", [1] * 10, SamplingParams(max_tokens=asked))
        assert intake.resolve(request).max_tokens == resolved


def test_the_callers_params_are_never_written(intake: RequestIntake) -> None:
    params = SamplingParams(n=3, seed=7, stop=["x"])
    before = repr(params), params.all_stop_token_ids, params.output_kind
    resolved = intake.resolve(
        EngineRequest("r", "hello", params, output_kind=RequestOutputKind.DELTA)
    )
    assert (repr(params), params.all_stop_token_ids, params.output_kind) == before
    assert resolved.params is not params
    assert resolved.params.all_stop_token_ids == EOS
    assert resolved.params.output_kind == RequestOutputKind.DELTA
    assert resolved.prompt == "hello" and resolved.prompt_token_ids


def test_each_sample_gets_one_sample_and_its_own_seed(intake: RequestIntake) -> None:
    resolved = intake.resolve(EngineRequest("r", [1, 2], SamplingParams(n=3, seed=7)))
    samples = resolved.sample_params()
    assert [(s.n, s.seed) for s in samples] == [(1, 7), (1, 8), (1, 9)]
    assert resolved.params.n == 3  # the request's own is not changed by its samples
    single = intake.resolve(EngineRequest("r", [1, 2], SamplingParams()))
    assert single.sample_params() == [single.params]


def test_every_field_of_the_request_reaches_the_resolved_request(intake: RequestIntake) -> None:
    """The request travels as one object: nothing the caller set is dropped on the way."""
    request = EngineRequest(
        "r",
        "hello",
        SamplingParams(),
        arrival_time=123.0,
        add_special_tokens=False,
        priority=-2,
        cache_salt="tenant",
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    resolved = intake.resolve(request)
    assert (resolved.request_id, resolved.arrival_time, resolved.priority) == ("r", 123.0, -2)
    assert resolved.cache_salt == "tenant"
    assert resolved.params.output_kind == RequestOutputKind.FINAL_ONLY
    with_specials = intake.resolve(EngineRequest("r", "hello", SamplingParams()))
    assert resolved.prompt_token_ids == tuple(
        intake.tokenizer.encode("hello", add_special_tokens=False)
    )
    assert with_specials.prompt_token_ids != resolved.prompt_token_ids  # BOS, by default
    assert with_specials.arrival_time > 123.0  # stamped at the intake when not given


def test_samples_have_their_own_ids_and_the_request_keeps_its_own(intake: RequestIntake) -> None:
    three = intake.resolve(EngineRequest("r", [1, 2], SamplingParams(n=3)))
    assert three.sample_ids() == ["0_r", "1_r", "2_r"] == [sample_id("r", i, 3) for i in range(3)]
    assert three.request_id == "r"
    assert intake.resolve(EngineRequest("r", [1, 2], SamplingParams())).sample_ids() == ["r"]
