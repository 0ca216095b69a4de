"""Structured outputs enforced while decoding: sampled JSON validates against its schema, regex
and choice outputs match, free requests in the same batch are untouched, and the matcher's
state survives chunked prefill, preemption, prefix caching, n > 1, an ITL target, captured
decode steps and speculative decoding (n-gram, EAGLE, Medusa: drafts cut at the grammar)."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import InvalidRequestError
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.manager import _fill
from tokenmill.structured_output.request_grammar import UNSATISFIABLE, RequestGrammar
from tokenmill.worker.capture_backends import eager_capture
from tokenmill_testing import random_checkpoint as rc

PROMPT = "Reverse this list: apple banana cherry"

# Strings are bounded: a random model picks a closing quote as rarely as any other token.
PET = {
    "type": "object",
    "properties": {
        "n": {"type": "string", "maxLength": 3},
        "k": {"enum": ["cat", "dog"]},
        "a": {"type": "integer", "minimum": 1, "maximum": 20},
        "t": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
        "o": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["id"],
            "additionalProperties": False,
        },
    },
    "required": ["n", "k", "a", "t", "o"],
    "additionalProperties": False,
}
SCORES = {
    "type": "array",
    "items": {"type": "integer", "minimum": -50, "maximum": 50},
    "minItems": 2,
    "maxItems": 4,
}


def constrained(seed: int = 0, n: int = 1, max_tokens: int = 96, **kind) -> SamplingParams:
    # Without extra whitespace, as vLLM's disable_any_whitespace: a random model chooses
    # whitespace as readily as anything else and would pad to max_tokens.
    structured = StructuredOutputsParams(disable_any_whitespace=True, **kind)
    return SamplingParams(
        n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=structured
    )


@pytest.mark.parametrize("which", ["demo", "random"])
@pytest.mark.slow(reason="fifty sampled completions per schema")
def test_fifty_sampled_completions_validate_against_each_schema(which, request) -> None:
    llm: LLM = request.getfixturevalue(f"{which}_llm")
    params = [constrained(seed=1, n=50, json=PET), constrained(seed=2, n=50, json=SCORES)]
    outputs = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    for output, schema in zip(outputs, (PET, SCORES)):
        assert len(output.outputs) == 50
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), schema)
        assert len({c.text for c in output.outputs}) > 10  # sampled, not one forced string


def test_regex_and_choice_outputs_match(random_llm: LLM) -> None:
    pattern = r"[a-z]{2,5}-\d{3}"
    choices = ["yes", "no", "maybe later"]
    regex_out, choice_out = random_llm.generate(
        [PROMPT, PROMPT],
        [constrained(seed=3, n=20, regex=pattern), constrained(seed=4, n=20, choice=choices)],
        use_tqdm=False,
    )
    assert all(re.fullmatch(pattern, c.text) for c in regex_out.outputs)
    assert all(c.text in choices for c in choice_out.outputs)


def test_masked_tokens_get_no_probability(random_llm: LLM) -> None:
    params = constrained(choice=["yes", "no", "maybe"], max_tokens=4)
    params.logprobs = 5
    out = random_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    tokenizer = random_llm.engine.tokenizer
    first = {tokenizer.decode([t]): p.logprob for t, p in out.logprobs[0].items()}
    allowed = {text for text, logprob in first.items() if logprob > float("-inf")}
    assert allowed and all(any(c.startswith(t) for c in ("yes", "no", "maybe")) for t in allowed)


def test_free_requests_get_the_tokens_they_get_alone(random_llm: LLM) -> None:
    free = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
    ]
    prompts = ["Once upon a time", "The quick brown fox"]
    alone = [o.outputs[0].token_ids for o in random_llm.generate(prompts, free, use_tqdm=False)]
    mixed = random_llm.generate(
        [*prompts, PROMPT, PROMPT],
        [*free, constrained(seed=5, n=4, json=PET), constrained(seed=6, regex=r"\d+")],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert all(json.loads(c.text) for c in mixed[2].outputs)


def test_max_tokens_mid_object_is_length(random_llm: LLM) -> None:
    out = random_llm.generate(PROMPT, constrained(json=PET, max_tokens=5), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == 5 and completion.text.startswith('{"')


def test_min_tokens_past_the_grammar_end_stops_cleanly(random_llm: LLM) -> None:
    """The grammar wins over min_tokens (as in vLLM): once it can only end, the stop token
    min_tokens would ban is sampled and the request stops with a valid output."""
    choices = ["yes", "no"]
    params = [
        constrained(seed=9, n=4, choice=choices),
        constrained(seed=10, json={"type": "integer", "minimum": 1, "maximum": 9}),
    ]
    for p in params:
        p.min_tokens = 20
    choice_out, integer_out = random_llm.generate([PROMPT] * 2, params, use_tqdm=False)
    for completion in [*choice_out.outputs, *integer_out.outputs]:
        assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    assert all(c.text in choices for c in choice_out.outputs)
    assert 1 <= json.loads(integer_out.outputs[0].text) <= 9


@pytest.mark.parametrize(
    "kind, value, message",
    [
        ("json", {"type": "object", "properties": {"a": {"type": "nope"}}}, "JSON schema"),
        ("json", {"type": "integer", "minimum": "zero"}, "JSON schema"),
        ("regex", "(ab", "regular expression"),
        ("grammar", "root ::= undefined_rule", "EBNF grammar"),
    ],
)
def test_invalid_constraint_is_rejected_before_any_work(random_llm, kind, value, message) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**{kind: value}))
    with pytest.raises(InvalidRequestError, match=message) as error:
        random_llm.generate(PROMPT, params, use_tqdm=False)
    assert error.value.param == "structured_outputs"
    assert not random_llm.engine.has_unfinished_requests()


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        SamplingParams(structured_outputs={"disable_any_whitespace": True})
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{oops")


def test_equal_schemas_compile_once(tiny_checkpoint) -> None:
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", max_model_len=128)
    params = [constrained(json=PET), constrained(json=dict(PET)), constrained(regex="a+")]
    llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert llm.engine.parts.structured_output.num_cached_grammars == 2


# A word-level vocabulary that cannot spell "z".
WORDS = [rc.UNK_TOKEN, rc.BOS_TOKEN, rc.EOS_TOKEN, rc.PAD_TOKEN, rc.IM_START_TOKEN]
WORDS += [rc.IM_END_TOKEN, "a", "b", "ab", "c"]


@pytest.fixture
def words_checkpoint(tiny_checkpoint, tmp_path) -> str:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, rc.UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    rc.wrap_tokenizer(tokenizer, 256).save_pretrained(tmp_path)
    return str(tiny_checkpoint("llama", tokenizer_dir=tmp_path))


def test_grammar_the_vocabulary_cannot_satisfy_finishes_with_a_reason(words_checkpoint) -> None:
    """A word-level vocabulary of a, b, ab, c cannot spell "z": the request ends with
    finish_reason "error" and the reason, after the tokens that could be generated."""
    llm = LLM(model=words_checkpoint, dtype="float32", max_model_len=64)
    params = [constrained(regex=r"ab+c", max_tokens=10), constrained(regex="abz")]
    satisfiable, unsatisfiable = llm.generate(["a b", "a b"], params, use_tqdm=False)
    assert satisfiable.outputs[0].finish_reason == "stop"
    completion = unsatisfiable.outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("error", UNSATISFIABLE)
    assert completion.token_ids == [WORDS.index("ab")]


def test_a_draft_into_a_dead_end_ends_the_request_only_if_accepted(words_checkpoint) -> None:
    """Under "c(bz|a)", "c" then "b" is a dead end. The prompt makes n-gram lookup draft "b"
    after "c": the request ends with finish_reason "error" only where the target samples
    that "b" itself, so outputs (per seed) are those of the engine without speculation."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    params = [
        SamplingParams(
            temperature=3.0, seed=seed, max_tokens=6, structured_outputs={"regex": "c(bz|a)"}
        )
        for seed in range(12)
    ]

    def run(**kwargs) -> list[tuple]:
        llm = LLM(model=words_checkpoint, dtype="float32", max_model_len=64, **kwargs)
        outputs = llm.generate(["c b c b c b"] * len(params), params, use_tqdm=False)
        completions = [o.outputs[0] for o in outputs]
        return [(c.token_ids, c.finish_reason, c.stop_reason) for c in completions]

    plain = run()
    assert {reason for _, reason, _ in plain} == {"stop", "error"}  # both paths are taken
    assert run(speculative_config=spec) == plain


def test_drafts_ending_the_grammar_with_its_stop_token_get_masks(words_checkpoint) -> None:
    """Drafts "ab" then EOS complete the regex "ab": the rows before and at each draft are
    the grammar's, and the row after the stop token (never sampled from: the request ends
    there) allows every token instead of asking a terminated matcher for a mask (which
    raised, and failed the whole step)."""
    llm = LLM(model=words_checkpoint, dtype="float32", max_model_len=64)
    manager = llm.engine.parts.structured_output
    grammar = manager.request_grammar(constrained(regex="ab"))
    while not grammar.is_ready():
        time.sleep(0.01)
    eos = WORDS.index(rc.EOS_TOKEN)
    drafts = grammar.valid_prefix([WORDS.index("ab"), eos, WORDS.index("c")])
    assert drafts == [WORDS.index("ab"), eos]  # nothing after the grammar's end
    bitmask = manager._rows(len(drafts) + 1)
    assert _fill(grammar, drafts, bitmask, 0) == 3
    allowed = [
        {t for t in range(len(WORDS)) if bitmask[row, t // 32] >> (t % 32) & 1} for row in range(3)
    ]
    assert WORDS.index("ab") in allowed[0] and WORDS.index("c") not in allowed[0]
    assert allowed[1] == {eos}
    assert allowed[2] == set(range(len(WORDS)))
    assert not grammar.is_terminated  # the matcher is back where it was


CONFIGS = {
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "recompute": {"num_kv_blocks": 14, "enable_prefix_caching": False},
    "swap": {"num_kv_blocks": 14, "preemption_mode": "swap", "enable_prefix_caching": False},
    # A small budget admits the prompts over several steps: a block is found in the prefix
    # cache only once the step that wrote it has completed.
    "prefix-caching": {"enable_prefix_caching": True, "max_num_batched_tokens": 16},
    "ngram-speculation": {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    },
    # The target drafts for itself (its model filled in by the test): argmax drafts, blind to
    # the grammar, from a proposer that keeps its own KV and catches up after cut drafts.
    "draft-model": {
        "speculative_config": {
            "method": "draft_model",
            "num_speculative_tokens": 3,
            "adaptive": False,
        }
    },
    # A tiny inter-token-latency target: prompts cut to the floor of prompt tokens per step.
    "itl-target": {"itl_target_ms": 0.001},
    # Decode-only steps through the bucketed captured step (its bookkeeping, no compiler).
    "captured-decode": {"max_num_seqs": 12},
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.slow(reason="an engine per feature")
def test_constrained_output_is_identical_across_engine_features(tiny_checkpoint, config) -> None:
    """Seeded sampling is a function of (seed, position), so any engine gives the same tokens;
    a matcher that lost or repeated a token under these features would change them."""
    checkpoint = str(tiny_checkpoint("llama"))
    prompts = [f"{PROMPT} {i} and {'dog ' * (6 + 3 * i)}" for i in range(6)]
    params = [
        constrained(seed=i, n=2, json=PET) if i % 2 else constrained(seed=i, regex=r"(ab|c)+d")
        for i in range(6)
    ]

    def run(**kwargs) -> tuple[list[list[list[int]]], LLM]:
        llm = LLM(model=checkpoint, dtype="float32", max_model_len=96, block_size=8, **kwargs)
        if config == "captured-decode" and kwargs:
            llm.engine.runner.use_captured_decode(12, 96, capture=eager_capture)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outputs], llm

    settings = dict(CONFIGS[config])
    if config == "draft-model":
        settings["speculative_config"] = {**settings["speculative_config"], "model": checkpoint}
    tokens, llm = run(**settings)
    assert tokens == run()[0]
    stats = llm.get_stats().scheduler
    if config in ("recompute", "swap"):
        assert stats.num_preemptions_by_mode[config] > 0
    if config == "prefix-caching":
        assert stats.prefix_cache.hits > 0
    if config in ("ngram-speculation", "draft-model"):
        assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0
    if config == "itl-target":
        assert stats.itl_target is not None and stats.itl_target.num_steps_over_target > 0
    if config == "captured-decode":
        assert llm.engine.runner.decode_step.num_runs > 0


@pytest.mark.slow(reason="starts tensor-parallel worker processes")
def test_tensor_parallel_ranks_sample_what_one_rank_does(tiny_checkpoint) -> None:
    """Every rank receives the step's bitmask inside the broadcast SchedulerOutput and masks
    the same all-gathered logits, so two ranks sample the tokens one does (the vocabulary
    splits unevenly: the last rank's shard is padded)."""
    checkpoint = str(tiny_checkpoint("llama", vocab_size=1021))
    params = [constrained(seed=1, n=2, json=PET), constrained(seed=2, regex=r"(ab|c)+d")]
    settings = {"dtype": "float32", "max_model_len": 128}
    single = LLM(checkpoint, **settings)
    outputs = single.generate([PROMPT] * 2, params, use_tqdm=False)
    expected = [[c.token_ids for c in o.outputs] for o in outputs]
    sharded = LLM(checkpoint, tensor_parallel_size=2, **settings)
    try:
        outputs = sharded.generate([PROMPT] * 2, params, use_tqdm=False)
    finally:
        sharded.engine.shutdown()
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    for completion in outputs[0].outputs:
        jsonschema.validate(json.loads(completion.text), PET)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.slow(reason="the demo model with each head")
def test_heads_drafts_are_cut_at_the_grammar_and_verified(method, monkeypatch) -> None:
    """EAGLE and Medusa draft from the target's hidden states, blind to the grammar: a
    request's drafts are cut at the first token its grammar rejects and the rest verified
    against masked logits, so seeded outputs are the engine's without speculation."""
    proposed, kept = [], []
    valid_prefix = RequestGrammar.valid_prefix

    def counting(self: RequestGrammar, drafts: list[int]) -> list[int]:
        prefix = valid_prefix(self, drafts)
        proposed.append(len(drafts))
        kept.append(len(prefix))
        return prefix

    monkeypatch.setattr(RequestGrammar, "valid_prefix", counting)
    prompts = [PROMPT, PROMPT, "Tell me a story about a dog."]
    params = [
        constrained(seed=7, n=3, json=PET),
        constrained(seed=8, regex=r"(ab|c)+d"),
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
    ]

    def run(spec: dict | None) -> tuple[list[list[list[int]]], LLM, list[str]]:
        llm = LLM(dtype="float32", max_model_len=256, speculative_config=spec)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        texts = [c.text for c in outputs[0].outputs]
        return [[c.token_ids for c in o.outputs] for o in outputs], llm, texts

    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    tokens, llm, texts = run(spec)
    assert tokens == run(None)[0]
    for text in texts:
        jsonschema.validate(json.loads(text), PET)
    stats = llm.get_stats().scheduler.spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
    # Constrained rows drafted; the grammar cut some drafts and let others be verified.
    assert 0 < sum(kept) < sum(proposed)
