"""Benchmark workloads, generated locally and reproducibly from a seed (nothing downloaded).

Each dataset is a list of `SampleRequest`s: a text prompt with an exact token count for the
model's tokenizer (see `text.fit_text`) and the number of tokens to generate. Requests are
sent with `ignore_eos`, so the output lengths are the dataset's, not the model's whim.

- `random`: input/output lengths fixed, or uniform in `len * [1 - r, 1 + r]` (vLLM's
  `--random-range-ratio`).
- `random-ids`: the `random` lengths, each prompt a list of token ids drawn uniformly from the
  tokenizer's non-special tokens (SGLang's name), sent as `/v1/completions`' `prompt` as is:
  every server sees the same tokens whatever its own tokenizer (tokenmill, vLLM and
  llama-server take id prompts; benchmarks/peers). No BOS is added.
- `sharegpt-like`: heavy-tailed lengths matching the ShareGPT statistics published in the
  vLLM paper (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
  PagedAttention", SOSP 2023, Fig. 11a): mean input 161.31 tokens, mean output 337.99 tokens.
  The paper gives means and histograms, not a fit: we draw each length independently from a
  log-normal with sigma 1.0 (our choice, a right tail like the histograms'), keep lengths in
  [4, 1024] as vLLM's ShareGPT loader does (it drops prompts or outputs under 4 tokens and
  prompts over 1024), and set mu so that the mean *after* that filter equals the paper's.
  `sharegpt_scale` shrinks every length by one factor for small machines; shapes and ratios
  between configurations keep their meaning.
- `shared-prefix`: a common system prompt + examples block of `prefix_len` tokens
  (`num_prefixes` different ones), then a varied user part of `suffix_len` tokens.
- `long-doc-mix`: chat-sized requests (the `random` lengths) with a fraction of very long
  document prompts at random positions; each request is labelled `short` or `long`, so the
  report can show what long prefills do to the short requests' inter-token latency.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, fields
from statistics import NormalDist

from tokenmill.bench.text import Tokenizer, fit_text

DATASET_NAMES = ("random", "random-ids", "sharegpt-like", "shared-prefix", "long-doc-mix")

# vLLM paper, Fig. 11a (ShareGPT), and vLLM's ShareGPT length filter.
SHAREGPT_MEAN_INPUT_LEN = 161.31
SHAREGPT_MEAN_OUTPUT_LEN = 337.99
SHAREGPT_SIGMA = 1.0
SHAREGPT_MIN_LEN, SHAREGPT_MAX_LEN = 4, 1024

# The shortest prompt generated: one text token after the special tokens (an empty prompt is
# rejected by OpenAI-compatible servers).
MIN_PROMPT_LEN = 2

SYSTEM_PROMPT = (
    "You are a careful assistant. Answer in plain English, briefly, and say so when you do "
    "not know. Here are examples of the style we want:\n\n"
)


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # token ids only for /v1/completions (`random-ids`)
    prompt_len: int  # tokens, counted as a completions prompt (special tokens included)
    expected_output_len: int
    category: str = "default"  # e.g. long-doc-mix's "short" / "long"


@dataclass
class DatasetConfig:
    """Every dataset knob; each dataset reads the fields it needs."""

    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    sharegpt_scale: float = 1.0
    prefix_len: int = 256
    suffix_len: int = 32
    num_prefixes: int = 1
    prefix_output_len: int = 32
    long_doc_len: int = 1024
    long_doc_output_len: int = 16
    long_doc_fraction: float = 0.1

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"dataset must be one of {DATASET_NAMES}, got {self.name!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if not 0.0 <= self.long_doc_fraction <= 1.0:
            raise ValueError(f"long_doc_fraction must be in [0, 1], got {self.long_doc_fraction}")
        if self.sharegpt_scale <= 0:
            raise ValueError(f"sharegpt_scale must be > 0, got {self.sharegpt_scale}")
        for name in ("random_input_len", "prefix_len", "suffix_len", "long_doc_len"):
            if getattr(self, name) < MIN_PROMPT_LEN - 1:
                raise ValueError(f"{name} must be >= {MIN_PROMPT_LEN - 1}")
        for name in ("random_output_len", "prefix_output_len", "long_doc_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_prefixes < 1:
            raise ValueError(f"num_prefixes must be >= 1, got {self.num_prefixes}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DatasetConfig:
        return cls(**dataset_overrides(args))


def add_dataset_args(parser: argparse.ArgumentParser, with_defaults: bool = True) -> None:
    """The dataset flags. `with_defaults=False` leaves unset flags None, for callers (presets)
    that fill in their own defaults."""
    group = parser.add_argument_group("dataset (generated locally from --seed)")
    d = DatasetConfig()

    def add(flag: str, help_text: str | None = None, **kwargs: object) -> None:
        name = flag.lstrip("-").replace("-", "_")
        default = getattr(d, "name" if name == "dataset_name" else name)
        group.add_argument(
            flag, default=default if with_defaults else None, help=help_text, **kwargs
        )

    add("--dataset-name", "the kind of workload", choices=DATASET_NAMES)
    add("--num-prompts", "requests to send", type=int)
    add("--random-input-len", "random: prompt tokens (see --random-range-ratio)", type=int)
    add("--random-output-len", "random: output tokens (see --random-range-ratio)", type=int)
    add("--random-range-ratio", "lengths uniform in len*[1-r, 1+r]; 0 = fixed", type=float)
    add("--sharegpt-scale", "multiply sharegpt-like lengths (keeps the shape)", type=float)
    add("--prefix-len", "shared-prefix: shared tokens", type=int)
    add("--suffix-len", "shared-prefix: per-request tokens after the prefix", type=int)
    add("--num-prefixes", "shared-prefix: distinct prefixes", type=int)
    add("--prefix-output-len", "shared-prefix: output tokens", type=int)
    add("--long-doc-len", "long-doc-mix: prompt tokens of a long document", type=int)
    add("--long-doc-output-len", "long-doc-mix: output tokens of a long document", type=int)
    add("--long-doc-fraction", "long-doc-mix: share of requests that are long", type=float)


def dataset_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The DatasetConfig fields set on the command line (those not None)."""
    names = {f.name for f in fields(DatasetConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if getattr(args, "dataset_name", None) is not None:
        values["name"] = args.dataset_name
    return values


def generate_dataset(config: DatasetConfig, tokenizer: Tokenizer) -> list[SampleRequest]:
    """The same config and tokenizer always give the same requests."""
    rng = random.Random(config.seed)
    generators = {
        "random": _random,
        "random-ids": _random_ids,
        "sharegpt-like": _sharegpt_like,
        "shared-prefix": _shared_prefix,
        "long-doc-mix": _long_doc_mix,
    }
    return generators[config.name](config, tokenizer, rng)


def _request(
    tokenizer: Tokenizer, rng: random.Random, input_len: int, output_len: int, **kwargs: object
) -> SampleRequest:
    input_len = max(input_len, MIN_PROMPT_LEN)
    prompt = fit_text(tokenizer, rng, input_len, **kwargs)
    return SampleRequest(prompt, input_len, output_len)


def _around(rng: random.Random, length: int, ratio: float) -> int:
    return rng.randint(math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio)))


def _random(config: DatasetConfig, tokenizer: Tokenizer, rng: random.Random) -> list[SampleRequest]:
    r = config.random_range_ratio
    return [
        _request(
            tokenizer,
            rng,
            _around(rng, config.random_input_len, r),
            max(1, _around(rng, config.random_output_len, r)),
        )
        for _ in range(config.num_prompts)
    ]


def _random_ids(
    config: DatasetConfig, tokenizer: Tokenizer, rng: random.Random
) -> list[SampleRequest]:
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    r = config.random_range_ratio
    requests = []
    for _ in range(config.num_prompts):
        input_len = max(_around(rng, config.random_input_len, r), 1)
        output_len = max(1, _around(rng, config.random_output_len, r))
        prompt = [rng.choice(ids) for _ in range(input_len)]
        requests.append(SampleRequest(prompt, input_len, output_len))
    return requests


def _sharegpt_like(
    config: DatasetConfig, tokenizer: Tokenizer, rng: random.Random
) -> list[SampleRequest]:
    mu_in = lognormal_mu_for_mean(SHAREGPT_MEAN_INPUT_LEN, SHAREGPT_SIGMA)
    mu_out = lognormal_mu_for_mean(SHAREGPT_MEAN_OUTPUT_LEN, SHAREGPT_SIGMA)
    requests = []
    for _ in range(config.num_prompts):
        input_len = _filtered_lognormal(rng, mu_in, SHAREGPT_SIGMA)
        output_len = _filtered_lognormal(rng, mu_out, SHAREGPT_SIGMA)
        scale = config.sharegpt_scale
        requests.append(
            _request(tokenizer, rng, round(input_len * scale), max(1, round(output_len * scale)))
        )
    return requests


def _filtered_lognormal(rng: random.Random, mu: float, sigma: float, max_draws: int = 1000) -> int:
    """A draw kept inside [SHAREGPT_MIN_LEN, SHAREGPT_MAX_LEN] (rejection, as vLLM filters)."""
    for _ in range(max_draws):
        value = round(rng.lognormvariate(mu, sigma))
        if SHAREGPT_MIN_LEN <= value <= SHAREGPT_MAX_LEN:
            return value
    raise ValueError(f"log-normal(mu={mu}, sigma={sigma}) rarely falls inside the filter")


def lognormal_mu_for_mean(
    mean: float, sigma: float, lo: float = SHAREGPT_MIN_LEN, hi: float = SHAREGPT_MAX_LEN
) -> float:
    """The mu whose log-normal, restricted to [lo, hi], has this mean (bisection)."""
    low, high = math.log(lo), math.log(hi)
    for _ in range(100):
        mid = (low + high) / 2
        if truncated_lognormal_mean(mid, sigma, lo, hi) < mean:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def truncated_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[X | lo <= X <= hi] for X ~ LogNormal(mu, sigma)."""
    phi = NormalDist().cdf
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    mass = phi(b) - phi(a)
    return math.exp(mu + sigma**2 / 2) * (phi(b - sigma) - phi(a - sigma)) / mass


def _shared_prefix(
    config: DatasetConfig, tokenizer: Tokenizer, rng: random.Random
) -> list[SampleRequest]:
    prefixes = [
        fit_text(tokenizer, rng, config.prefix_len, head=SYSTEM_PROMPT, tail="\n\n")
        for _ in range(config.num_prefixes)
    ]
    requests = []
    for i in range(config.num_prompts):
        requests.append(
            _request(
                tokenizer,
                rng,
                config.prefix_len + config.suffix_len,
                config.prefix_output_len,
                head=f"{prefixes[i % len(prefixes)]}Question {i + 1}: ",  # all differ
                tail="\nAnswer:",
            )
        )
    rng.shuffle(requests)
    return requests


def _long_doc_mix(
    config: DatasetConfig, tokenizer: Tokenizer, rng: random.Random
) -> list[SampleRequest]:
    num_long = round(config.num_prompts * config.long_doc_fraction)
    if config.long_doc_fraction > 0 and config.num_prompts >= 2:
        num_long = max(1, num_long)
    # Never first: a long document should land while short requests are decoding.
    positions = set(rng.sample(range(1, config.num_prompts), min(num_long, config.num_prompts - 1)))
    short = _random(config, tokenizer, rng)
    requests = []
    for i in range(config.num_prompts):
        if i in positions:
            long = _request(
                tokenizer,
                rng,
                config.long_doc_len,
                config.long_doc_output_len,
                head="Summarize the following document.\n\n",
            )
            requests.append(_with_category(long, "long"))
        else:
            requests.append(_with_category(short[i], "short"))
    return requests


def _with_category(request: SampleRequest, category: str) -> SampleRequest:
    return SampleRequest(request.prompt, request.prompt_len, request.expected_output_len, category)


def describe(requests: list[SampleRequest]) -> str:
    """One line for the console: how many requests and their length statistics."""
    ins = [r.prompt_len for r in requests]
    outs = [r.expected_output_len for r in requests]
    return (
        f"{len(requests)} requests; input tokens mean {sum(ins) / len(ins):.1f} "
        f"(min {min(ins)}, max {max(ins)}); output tokens mean {sum(outs) / len(outs):.1f} "
        f"(min {min(outs)}, max {max(outs)})"
    )
