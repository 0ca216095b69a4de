"""The oracle drafter of benchmarks/spec_decode_bound.py: drafting the target's own greedy
continuation, every draft is accepted and the outputs are those of a run without
speculation; a request that is not the reference's gets no drafts."""

from __future__ import annotations

import pytest

from benchmarks.spec_decode import generate_greedy
from benchmarks.spec_decode_bound import OracleProposer, oracle_engine, reference_run
from demo_training.acceptance import STORY_PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.step.runner_request_state import CachedRequestState

PROMPTS = [STORY_PROMPTS[0], STORY_PROMPTS[2]]  # plain text (BOS added), long replies


@pytest.fixture(scope="module")
def off() -> LLM:
    return LLM(model=None, max_num_seqs=1)


def test_oracle_drafts_are_all_accepted_and_change_no_output(off: LLM) -> None:
    continuations, lengths = reference_run(off, PROMPTS, max_tokens=24)
    assert min(lengths) > 10  # long enough that most steps draft k tokens
    k = 4
    oracle, proposer = oracle_engine(k)
    proposer.continuations = continuations
    outputs = generate_greedy(oracle, PROMPTS, max_tokens=24)
    for output in outputs:
        reference = continuations[tuple(output.prompt_token_ids)]
        assert reference == [*output.prompt_token_ids, *output.outputs[0].token_ids]
    stats = oracle.get_stats().scheduler.spec_decode
    assert stats is not None and stats.num_draft_tokens > 0
    # Greedy: a rejected draft would put another token in its place, failing the check above.
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    tokens_per_step = sum(len(o.outputs[0].token_ids) - 1 for o in outputs) / stats.num_drafts
    assert tokens_per_step > 0.8 * (k + 1)


def state(req_id: str, token_ids: list[int], num_prompt_tokens: int) -> CachedRequestState:
    return CachedRequestState(
        req_id, token_ids, num_prompt_tokens, SamplingParams(), [], len(token_ids)
    )


def test_oracle_drafts_nothing_for_a_request_off_its_reference() -> None:
    prompt = [1, 5, 9]
    oracle = OracleProposer({tuple(prompt): [*prompt, 7, 8, 9, 10]})
    on_track = state("a", [*prompt, 7], len(prompt))
    off_track = state("b", [*prompt, 6], len(prompt))
    unknown = state("c", [2, 3, 7], 2)
    assert oracle.propose([on_track, off_track, unknown], 2) == {"a": [8, 9]}
    assert oracle.propose([state("d", [*prompt, 7, 8, 9, 10], len(prompt))], 2) == {}
