"""Speculative decoding benchmark, offline, every configuration side by side in one run.

    python benchmarks/spec_decode.py [--model PATH] [--draft-model PATH] [--repeats 3]

1. Batch-1 decode tokens/s on prompts whose answer echoes the input (copy a passage): no
   speculation vs n-gram prompt lookup vs the draft model.
2. Throughput at concurrency 1, 8, 32, 64 (max_num_seqs = concurrency, 2x that many requests):
   speculation off, n-gram with a fixed k, n-gram with the adaptive policy.
Medians of interleaved repeats; greedy, so every configuration generates the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenmill import LLM, SamplingParams

PASSAGES = [
    "The little fox ran across the green field and jumped over the old fence by the river.",
    "Mira packed three apples, two books and a warm blanket before she walked to the station.",
    "Every morning the baker opens the shop, lights the oven and sings a song to the bread.",
    "The robot counted the blue boxes twice, wrote the number on a card and gave it to Sam.",
]


def echo_prompts(llm: LLM, count: int) -> list[str]:
    """Copy-a-passage requests, in the chat format when the tokenizer has a template."""
    tokenizer = llm.get_tokenizer()
    prompts = []
    for i in range(count):
        passage = " ".join(PASSAGES[(i + j) % len(PASSAGES)] for j in range(2))
        message = f"Repeat this text exactly: {passage}"
        if tokenizer.chat_template:
            message = tokenizer.apply_chat_template(
                [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
            )
        prompts.append(message)
    return prompts


def timed(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, add_special_tokens=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def median_tokens_per_s(
    engines: dict[str, LLM], prompts_for, max_tokens: int, repeats: int
) -> dict[str, float]:
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            seconds, tokens = timed(llm, prompts_for(llm), max_tokens)
            runs[name].append(tokens / seconds)
    return {name: statistics.median(r) for name, r in runs.items()}


def acceptance(llm: LLM) -> str:
    stats = llm.get_stats().scheduler.spec_decode
    if stats is None or not stats.num_draft_tokens:
        return ""
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    return f"  (acceptance {rate:.0%}, mean acceptance length {stats.mean_acceptance_length:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}

    print("## batch 1: echo-style prompts, tokens/s")
    batch1 = {
        "no speculation": LLM(model=args.model, max_num_seqs=1),
        "ngram k=4": LLM(model=args.model, max_num_seqs=1, speculative_config=ngram),
    }
    if args.draft_model:
        draft = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": 4}
        batch1["draft model k=4"] = LLM(model=args.model, max_num_seqs=1, speculative_config=draft)
    rates = median_tokens_per_s(
        batch1, lambda llm: echo_prompts(llm, 2), args.max_tokens, args.repeats
    )
    base = rates["no speculation"]
    for name, rate in rates.items():
        print(f"  {name:<20} {rate:8.1f} tok/s  {rate / base:5.2f}x{acceptance(batch1[name])}")
    del batch1

    print("\n## throughput by concurrency, tokens/s (echo-style prompts)")
    print(f"  {'concurrency':>11} {'off':>8} {'fixed k=4':>10} {'adaptive':>9}")
    for concurrency in (1, 8, 32, 64):
        engines = {
            "off": LLM(model=args.model, max_num_seqs=concurrency),
            "fixed": LLM(
                model=args.model,
                max_num_seqs=concurrency,
                speculative_config={**ngram, "adaptive": False},
            ),
            "adaptive": LLM(model=args.model, max_num_seqs=concurrency, speculative_config=ngram),
        }
        count = max(2 * concurrency, 4)
        rates = median_tokens_per_s(
            engines, lambda llm, n=count: echo_prompts(llm, n), args.max_tokens, args.repeats
        )
        off, fixed, adaptive = rates["off"], rates["fixed"], rates["adaptive"]
        print(
            f"  {concurrency:>11} {off:8.1f} {fixed:10.1f} {adaptive:9.1f}"
            f"   fixed/off {rates['fixed'] / rates['off']:.2f}x,"
            f" adaptive/off {rates['adaptive'] / rates['off']:.2f}x"
        )
        del engines


if __name__ == "__main__":
    main()
