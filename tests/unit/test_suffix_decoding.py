"""Suffix decoding's trie and proposer: longest match, frequency-weighted continuation,
the probability floor, the match-length cap, and the shared cache's eviction."""

from __future__ import annotations

import random

import pytest

from tokenmill.config.base import ConfigError
from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.suffix import SuffixDecodingProposer
from tokenmill.spec_decode.suffix_index import SuffixIndex
from tokenmill.step.runner_request_state import CachedRequestState


def _speculate(index: SuffixIndex, context: list[int], max_tokens: int = 8, **kwargs):
    options = {"max_spec_factor": 4.0, "min_token_prob": 0.0, **kwargs}
    return index.speculate(context, max_tokens, **options)


def test_counts_every_substring_up_to_the_depth() -> None:
    index = SuffixIndex(max_depth=3)
    tokens = [random.Random(0).randrange(4) for _ in range(60)]
    index.extend("a", tokens[:25])
    index.extend("a", tokens[25:])  # grown in two pieces: same as all at once
    for length in (1, 2, 3):
        for start in range(len(tokens) - length + 1):
            pattern = tokens[start : start + length]
            node = index._walk(pattern, 0)
            expected = sum(
                tokens[i : i + length] == pattern for i in range(len(tokens) - length + 1)
            )
            assert node is not None and node.count == expected
    assert all(len(child.children) == 0 for child in _nodes_at_depth(index, 3))


def _nodes_at_depth(index: SuffixIndex, depth: int):
    level = [index.root]
    for _ in range(depth):
        level = [child for node in level for child in node.children.values()]
    return level


def test_the_longest_match_decides_the_continuation() -> None:
    index = SuffixIndex(max_depth=8)
    # "9 1 2" is followed by 5 once; "1 2" alone is followed by 7 three times.
    index.extend("a", [1, 2, 7, 0, 1, 2, 7, 0, 1, 2, 7, 0, 9, 1, 2, 5, 6])
    long_match = _speculate(index, [3, 9, 1, 2], max_tokens=2)
    assert long_match.token_ids == [5, 6]
    assert long_match.match_len == 3
    short_match = _speculate(index, [3, 8, 1, 2], max_tokens=2)
    assert short_match.token_ids == [7, 0]


def test_the_most_frequent_branch_wins_with_its_share_as_probability() -> None:
    index = SuffixIndex(max_depth=4)
    for key, follower in enumerate([5, 6, 6, 6]):
        index.extend(key, [1, 2, follower])
    draft = _speculate(index, [1, 2], max_tokens=1)
    assert draft.token_ids == [6]
    assert draft.probs == [pytest.approx(0.75)]


def test_min_token_prob_stops_the_chain() -> None:
    index = SuffixIndex(max_depth=6)
    # After 1 2: 3 always; after 1 2 3: 4 twice, 5 once, 6 once (0.5 of the mass).
    for key, tail in enumerate([4, 4, 5, 6]):
        index.extend(key, [1, 2, 3, tail])
    assert _speculate(index, [1, 2], min_token_prob=0.4).token_ids == [3, 4]
    assert _speculate(index, [1, 2], min_token_prob=0.6).token_ids == [3]


def test_max_spec_factor_bounds_drafts_by_match_length() -> None:
    index = SuffixIndex(max_depth=16)
    index.extend("a", list(range(12)))
    assert _speculate(index, [0, 1], max_tokens=8, max_spec_factor=1.0).token_ids == [2, 3]
    assert _speculate(index, [0, 1], max_tokens=8, max_spec_factor=2.0).token_ids == [2, 3, 4, 5]
    assert _speculate(index, [0, 1], max_tokens=3, max_spec_factor=2.0).token_ids == [2, 3, 4]


def test_own_sequence_leaves_out_the_uncontinued_occurrence() -> None:
    index = SuffixIndex(max_depth=4)
    sequence = [1, 2, 3, 9, 1, 2]  # "1 2" occurred once before, followed by 3
    index.extend(0, sequence)
    assert _speculate(index, sequence, max_tokens=1).probs == [pytest.approx(0.5)]
    own = index.speculate_own(0, 1, max_spec_factor=4.0, min_token_prob=0.0)
    assert own.token_ids == [3] and own.probs == [pytest.approx(1.0)]


def test_own_sequence_matches_are_the_nodes_walking_its_end_finds() -> None:
    rng = random.Random(2)
    index = SuffixIndex(max_depth=6)
    sequence: list[int] = []
    for _ in range(80):  # grown a token at a time, as a request's trie is
        token = rng.randrange(4)
        sequence.append(token)
        index.extend(0, [token])
        walked = [index._walk(sequence[-n:], 0) for n in range(1, min(len(sequence), 5) + 1)]
        assert [node for node, _ in index._open[0]] == walked


def test_removing_a_sequence_restores_the_index() -> None:
    rng = random.Random(1)
    first = [rng.randrange(5) for _ in range(40)]
    second = [rng.randrange(5) for _ in range(30)]
    alone = SuffixIndex(max_depth=5)
    alone.extend("b", second)
    both = SuffixIndex(max_depth=5)
    both.extend("a", first)
    both.extend("b", second)
    both.remove("a", first)
    assert _snapshot(both.root) == _snapshot(alone.root)
    with pytest.raises(ValueError, match="not indexed"):
        both.remove("b", second[:-1])


def _snapshot(node) -> tuple:
    return node.count, {t: _snapshot(c) for t, c in node.children.items()}


def _state(req_id: str, prompt: list[int], output: list[int] = ()) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        token_ids=[*prompt, *output],
        num_prompt_tokens=len(prompt),
        sampling_params=SamplingParams(),
        block_ids=[],
        num_computed_tokens=0,
    )


def test_proposer_drafts_from_the_request_and_follows_its_growth() -> None:
    proposer = SuffixDecodingProposer(24, 10, 1.0, 0.1)
    state = _state("r", [5, 6, 7, 8, 1, 2, 3, 4, 9, 5, 6])
    assert proposer.propose([state], 4) == {"r": [7, 8]}  # match "5 6": 2 tokens at factor 1
    state.append([7, 8, 1])
    assert proposer.propose([state], 4) == {"r": [2, 3, 4, 9]}


def test_finished_outputs_are_shared_and_the_oldest_evicted() -> None:
    proposer = SuffixDecodingProposer(24, 2, 1.0, 0.1)
    outputs = {name: [100 + 10 * i + j for j in range(6)] for i, name in enumerate("abc")}
    for name, output in outputs.items():
        proposer.propose([_state(name, [1, 2], output)], 4)
        proposer.release({name}, set())
    assert not proposer._local
    assert list(proposer._cached_outputs) == ["b", "c"]
    # A new request starts the way "b" went on: drafted from the cache; "a" was evicted.
    assert proposer.propose([_state("d", [0], outputs["b"][:3])], 3) == {"d": outputs["b"][3:]}
    assert proposer.propose([_state("e", [0], outputs["a"][:3])], 3) == {}


def test_a_preempted_request_is_reindexed_not_cached() -> None:
    proposer = SuffixDecodingProposer(24, 10, 1.0, 0.1)
    proposer.propose([_state("r", [1, 2, 3, 1, 2], [3])], 2)
    proposer.release(set(), {"r"})
    assert not proposer._local and not proposer._cached_outputs
    assert proposer.propose([_state("r", [1, 2, 3, 1, 2], [3, 1])], 2) == {"r": [2, 3]}


def test_config_takes_vllms_suffix_fields_and_checks_them() -> None:
    spec = SpeculativeConfig.parse(
        '{"method": "suffix", "suffix_decoding_max_tree_depth": 32, '
        '"suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0.2}'
    )
    assert spec.method == "suffix"
    assert spec.suffix_decoding_max_tree_depth == 32
    assert spec.suffix_decoding_max_spec_factor == 2
    assert spec.suffix_decoding_max_cached_requests == 10000
    with pytest.raises(ConfigError, match="min_token_prob"):
        SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}')
    with pytest.raises(ConfigError, match="max_tree_depth"):
        SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}')
    with pytest.raises(ConfigError, match="must be"):
        SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_spec_factor": "x"}')
