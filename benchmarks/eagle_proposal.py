"""What an EAGLE step costs at batch 1, split: target forward, proposal, the rest of the step.

    OMP_NUM_THREADS=1 python benchmarks/eagle_proposal.py [--k 4] [--max-tokens 48]
        [--tasks copy,sort,add] [--heads DIR]

The demo target with its EAGLE heads (or `--heads`), greedy, a fixed k, on held-out demo
prompts, next to the same target without speculation: the two engines generate the same
prompts in turn, three rounds. Thread CPU time (not wall time: on a loaded machine a process
waits for a core far longer than it computes) of every engine step, target forward (for EAGLE:
the verification of k + 1 tokens) and `EagleProposer.propose` call (catch-up over the accepted
tokens, then k drafts), their medians, and the step CPU time per generated token of each
engine, whose ratio is the speed-up in CPU time; and the mean acceptance length 2x would
need at this k, from the two engines' median step costs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from spec_decode import chat_prompts

from tokenmill import LLM, SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.spec_decode.eagle import EagleProposer
from tokenmill.worker.model_runner import ModelRunner

TIMES: dict[tuple[str, str], list[float]] = {}
CURRENT = {"engine": ""}


def cpu_timed(cls: type, name: str, label: str) -> None:
    original: Callable = getattr(cls, name)

    def timed(self, *args, **kwargs):
        start = time.thread_time()
        result = original(self, *args, **kwargs)
        TIMES.setdefault((CURRENT["engine"], label), []).append(time.thread_time() - start)
        return result

    setattr(cls, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--tasks", default="copy,sort,add")
    parser.add_argument("--heads", default=None, help="EAGLE heads (default: the demo's)")
    args = parser.parse_args()
    cpu_timed(LLMEngine, "step", "step")
    cpu_timed(ModelRunner, "_forward", "target forward")
    cpu_timed(EagleProposer, "propose", "proposal")
    spec = {"method": "eagle", "num_speculative_tokens": args.k, "adaptive": False}
    engines = {
        "off": LLM(model=None, max_num_seqs=1),
        f"eagle k={args.k}": LLM(
            model=None, max_num_seqs=1, speculative_config={**spec, "model": args.heads}
        ),
    }
    prompts = chat_prompts(engines["off"], args.tasks.split(","), 6)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tokens = dict.fromkeys(engines, 0)
    for llm in engines.values():  # warm up
        llm.generate(prompts[:1], params, use_tqdm=False, add_special_tokens=False)
    TIMES.clear()
    for _ in range(3):
        for name, llm in engines.items():
            CURRENT["engine"] = name
            outputs = llm.generate(prompts, params, use_tqdm=False, add_special_tokens=False)
            tokens[name] += sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"batch 1, {args.tasks}, thread CPU time, medians per call (ms)")
    per_token = {}
    for name in engines:
        parts = {label: 1e3 * statistics.median(v) for (n, label), v in TIMES.items() if n == name}
        per_token[name] = 1e3 * sum(TIMES[(name, "step")]) / tokens[name]
        cells = "  ".join(f"{label} {ms:6.2f}" for label, ms in parts.items())
        print(f"  {name:<10} {cells}  | step CPU per generated token {per_token[name]:.2f}")
    name = f"eagle k={args.k}"
    stats = engines[name].get_stats().scheduler.spec_decode
    if stats is not None and stats.num_drafts:
        length = 1 + stats.num_accepted_tokens / stats.num_drafts
        print(f"  mean acceptance length {length:.2f}")
    print(f"  EAGLE / off in CPU time per token: {per_token['off'] / per_token[name]:.2f}x")
    # A step of k drafts costs `ratio` plain steps, so 2x needs twice that many tokens a step.
    ratio = statistics.median(TIMES[(name, "step")]) / statistics.median(TIMES[("off", "step")])
    print(
        f"  an EAGLE step costs {ratio:.2f} plain steps: 2x needs a mean acceptance length of"
        f" {2 * ratio:.2f} (at most {args.k + 1} at k={args.k})"
    )


if __name__ == "__main__":
    main()
