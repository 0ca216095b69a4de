"""Benchmark datasets: exact token counts for the model's tokenizer, reproducible by seed."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenmill.bench.datasets import (
    DATASET_NAMES,
    SHAREGPT_MEAN_INPUT_LEN,
    SHAREGPT_MEAN_OUTPUT_LEN,
    DatasetConfig,
    generate_dataset,
    lognormal_mu_for_mean,
    truncated_lognormal_mean,
)
from tokenmill.bench.text import count_tokens, fit_text


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tokenizer_dir)


SMALL = {
    "num_prompts": 24,
    "random_input_len": 40,
    "random_output_len": 12,
    "prefix_len": 96,
    "suffix_len": 16,
    "long_doc_len": 300,
    "long_doc_fraction": 0.25,
    "sharegpt_scale": 0.5,
}


@pytest.mark.parametrize("name", DATASET_NAMES)
def test_every_prompt_has_exactly_its_token_count(name: str, tokenizer) -> None:
    requests = generate_dataset(DatasetConfig(name=name, **SMALL), tokenizer)
    assert len(requests) == SMALL["num_prompts"]
    for r in requests:
        if isinstance(r.prompt, list):  # random-ids: the ids are sent as they are
            assert len(r.prompt) == r.prompt_len
        else:
            assert count_tokens(tokenizer, r.prompt) == r.prompt_len
        assert r.expected_output_len >= 1


@pytest.mark.parametrize("name", DATASET_NAMES)
def test_same_seed_same_requests_other_seed_others(name: str, tokenizer) -> None:
    config = DatasetConfig(name=name, seed=7, **SMALL)
    first = generate_dataset(config, tokenizer)
    assert first == generate_dataset(config, tokenizer)
    other = generate_dataset(DatasetConfig(name=name, seed=8, **SMALL), tokenizer)
    assert [r.prompt for r in first] != [r.prompt for r in other]


def test_random_lengths_are_fixed_or_within_the_range(tokenizer) -> None:
    fixed = generate_dataset(DatasetConfig(name="random", **SMALL), tokenizer)
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(40, 12)}
    ranged = generate_dataset(
        DatasetConfig(name="random", **{**SMALL, "random_range_ratio": 0.5}), tokenizer
    )
    assert all(20 <= r.prompt_len <= 60 and 6 <= r.expected_output_len <= 18 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 5


def test_random_ids_are_ordinary_tokens_of_the_tokenizer_with_random_lengths(tokenizer) -> None:
    config = DatasetConfig(name="random-ids", **{**SMALL, "random_range_ratio": 0.5})
    requests = generate_dataset(config, tokenizer)
    special = set(tokenizer.all_special_ids)
    ids = [i for r in requests for i in r.prompt]
    assert all(isinstance(i, int) and 0 <= i < len(tokenizer) and i not in special for i in ids)
    assert len(set(ids)) > 200  # spread over the vocabulary, not a few ids
    assert all(20 <= r.prompt_len <= 60 and 6 <= r.expected_output_len <= 18 for r in requests)
    assert len({r.prompt_len for r in requests}) > 5


def test_shared_prefix_requests_share_their_prefix_tokens(tokenizer) -> None:
    config = DatasetConfig(name="shared-prefix", num_prefixes=2, **{**SMALL, "num_prompts": 12})
    requests = generate_dataset(config, tokenizer)
    assert {r.prompt_len for r in requests} == {96 + 16}
    heads = {tuple(tokenizer(r.prompt)["input_ids"][:96]) for r in requests}
    assert len(heads) == 2  # two distinct shared prefixes, each exactly 96 tokens long
    assert len({r.prompt for r in requests}) == 12  # user parts all differ


def test_long_doc_mix_labels_its_few_long_documents(tokenizer) -> None:
    requests = generate_dataset(DatasetConfig(name="long-doc-mix", **SMALL), tokenizer)
    long = [r for r in requests if r.category == "long"]
    assert len(long) == 6 and requests[0].category == "short"
    assert {r.prompt_len for r in long} == {300}
    assert all(r.prompt_len == 40 for r in requests if r.category == "short")


def test_sharegpt_like_matches_the_published_means() -> None:
    """vLLM paper, Fig. 11a: ShareGPT has mean input 161.31 and mean output 337.99 tokens."""
    for mean in (SHAREGPT_MEAN_INPUT_LEN, SHAREGPT_MEAN_OUTPUT_LEN):
        mu = lognormal_mu_for_mean(mean, 1.0)
        assert truncated_lognormal_mean(mu, 1.0, 4, 1024) == pytest.approx(mean, rel=1e-6)
        rng = random.Random(0)
        draws = [rng.lognormvariate(mu, 1.0) for _ in range(200_000)]
        kept = [x for x in draws if 4 <= x <= 1024]
        assert statistics.fmean(kept) == pytest.approx(mean, rel=0.01)


def test_sharegpt_like_lengths_are_heavy_tailed_and_filtered(tokenizer) -> None:
    requests = generate_dataset(
        DatasetConfig(name="sharegpt-like", num_prompts=300, sharegpt_scale=0.25), tokenizer
    )
    outputs = [r.expected_output_len for r in requests]
    assert statistics.fmean(outputs) == pytest.approx(SHAREGPT_MEAN_OUTPUT_LEN * 0.25, rel=0.15)
    assert statistics.fmean(outputs) > statistics.median(outputs)  # a right tail
    assert max(r.prompt_len for r in requests) <= 256  # 1024 * 0.25


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(min_value=24, max_value=700),
    seed=st.integers(min_value=0, max_value=10_000),
    head=st.sampled_from(["", "System: be brief.\n\n", "Question: "]),
    tail=st.sampled_from(["", "\nAnswer:"]),
)
def test_fit_text_hits_any_length_exactly(tokenizer, num_tokens, seed, head, tail) -> None:
    text = fit_text(tokenizer, random.Random(seed), num_tokens, head=head, tail=tail)
    assert count_tokens(tokenizer, text) == num_tokens
    assert text.startswith(head) and text.endswith(tail)


def test_fit_text_refuses_when_the_fixed_text_is_too_long(tokenizer) -> None:
    with pytest.raises(ValueError, match="fixed text"):
        fit_text(tokenizer, random.Random(0), 3, head="a much longer head than three tokens")
