"""The most speculative decoding can give at batch 1 on the demo tasks: an oracle drafter.

    OMP_NUM_THREADS=1 python -m benchmarks.spec_decode_bound [--k 2,4,8] [--tasks copy,add]
        [--repeats 3] [--max-tokens 128] [--prompts 8] [--eagle-k 4]

An oracle proposer drafts the target's own greedy continuation, taken from a run of the same
prompts without speculation: every draft is right (up to floating-point near-ties between
the verification's batched rows and the plain run's single ones) and proposing costs a
dictionary lookup. Its tokens/s over the same target without speculation, at batch 1 on the
same prompts, is the ceiling for any drafter (EAGLE, Medusa, a draft model, n-gram) at that
k in this engine: a real drafter only adds the cost of its proposal and gets some drafts
wrong. The shipped EAGLE heads (fixed k, `--eagle-k`) run beside them, in the same run.

Replies end where the model ends them, as in `spec_decode.py` (its prompts and timing); a
reply of n tokens takes the prefill (which samples the first) and n - 1 decode steps without
speculation, and at best the prefill and ceil((n - 1) / (k + 1)) verification steps with it,
so short replies bound the gain whatever the drafts.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.spec_decode import drafts_since, generate_greedy, task_prompts, timed
from tokenmill import LLM
from tokenmill.demo.tasks import CHECKABLE_TASKS
from tokenmill.metrics.stats import SpecDecodeStats
from tokenmill.step.runner_request_state import CachedRequestState


class OracleProposer:
    """Drafts the continuation a reference run produced for the same prompt."""

    proposal_threads: int | None = None  # the engine's threads

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations  # prompt token ids -> prompt + greedy output

    def propose(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        proposals = {}
        for state in states:
            reference = self.continuations.get(tuple(state.prompt_token_ids))
            if reference is None or reference[: len(state.token_ids)] != state.token_ids:
                continue  # an unknown prompt, or the run left the reference: no drafts
            drafts = reference[len(state.token_ids) : len(state.token_ids) + num_tokens]
            if drafts:
                proposals[state.req_id] = drafts
        return proposals


def oracle_engine(k: int) -> tuple[LLM, OracleProposer]:
    """The demo target at batch 1 drafting k tokens a step from an oracle (none known yet:
    set its `continuations`). The n-gram method's engine, its proposer swapped: that method
    has no draft KV or hidden-state hand-off that another proposer would miss."""
    spec = {"method": "ngram", "num_speculative_tokens": k, "adaptive": False}
    llm = LLM(model=None, max_num_seqs=1, speculative_config=spec)
    oracle = OracleProposer({})
    llm.engine.use_proposer(oracle)
    return llm, oracle


def reference_run(
    llm: LLM, prompts: list[str], max_tokens: int
) -> tuple[dict[tuple[int, ...], list[int]], list[int]]:
    """Greedy continuations without speculation, keyed by prompt token ids; reply lengths."""
    outputs = generate_greedy(llm, prompts, max_tokens)
    continuations = {
        tuple(o.prompt_token_ids): [*o.prompt_token_ids, *o.outputs[0].token_ids] for o in outputs
    }
    return continuations, [len(o.outputs[0].token_ids) for o in outputs]


def mean_acceptance_length(llm: LLM, before: SpecDecodeStats | None) -> float:
    """Tokens per verification step since `before` (NaN: no drafts)."""
    counts = drafts_since(llm, before)
    if counts is None or not counts.steps:
        return float("nan")
    return 1 + counts.accepted / counts.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", default="2,4,8", help="num_speculative_tokens of the oracles")
    parser.add_argument("--tasks", default=",".join([*CHECKABLE_TASKS, "story"]))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--prompts", type=int, default=8, help="held-out prompts a chat task (story: its 4)"
    )
    parser.add_argument("--eagle-k", type=int, default=4, help="0: the oracles alone")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]

    engines = {"off": LLM(model=None, max_num_seqs=1)}
    oracles = []
    for k in ks:
        engines[f"oracle k={k}"], oracle = oracle_engine(k)
        oracles.append(oracle)
    if args.eagle_k:
        eagle = {"method": "eagle", "num_speculative_tokens": args.eagle_k, "adaptive": False}
        engines[f"eagle k={args.eagle_k}"] = LLM(
            model=None, max_num_seqs=1, speculative_config=eagle
        )
    print(
        f"batch 1, greedy, {args.prompts} held-out prompts a chat task (story: 4 openings),"
        f" median of {args.repeats}"
    )
    print("tokens/s ratio to off (mean acceptance length: tokens per verification step)")
    header = " ".join(f"{name:>20}" for name in engines if name != "off")
    print(f"  {'task':<9} {'reply':>5} {'off tok/s':>9} {header}")
    for task in args.tasks.split(","):
        prompts = task_prompts(engines["off"], task, args.prompts)
        continuations, lengths = reference_run(engines["off"], prompts, args.max_tokens)
        for oracle in oracles:
            oracle.continuations = continuations
        before = {name: llm.get_stats().scheduler.spec_decode for name, llm in engines.items()}
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                llm.reset_prefix_cache()
                seconds, tokens = timed(llm, prompts, args.max_tokens)
                rates[name].append(tokens / seconds)
        medians = {name: statistics.median(r) for name, r in rates.items()}
        off = medians["off"]
        cells = " ".join(
            f"{medians[name] / off:>11.2f}x ({mean_acceptance_length(llm, before[name]):.2f})"
            for name, llm in engines.items()
            if name != "off"
        )
        print(f"  {task:<9} {statistics.mean(lengths):>5.1f} {off:>9.1f} {cells}", flush=True)


if __name__ == "__main__":
    main()
