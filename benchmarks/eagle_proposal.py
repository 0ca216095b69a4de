"""What an EAGLE proposal costs next to the target step it drafts for, at batch 1.

    OMP_NUM_THREADS=1 python benchmarks/eagle_proposal.py [--k 4] [--max-tokens 48]

The demo target with its EAGLE heads, greedy, a fixed k, on held-out copy / sort / add
prompts. Thread CPU time (not wall time: on a loaded machine a process waits for a core far
longer than it computes) of every `EagleProposer.propose` call (catch-up over the accepted
tokens, then k drafts) and of every target forward (the verification of k + 1 tokens), and
their medians. The ratio is what each draft costs in target steps: with verification at
about one step, greedy speculation at batch 1 runs at most
mean_acceptance_length / (1 + ratio) times plain decoding.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from spec_decode import chat_prompts

from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode.eagle import EagleProposer
from tokenmill.worker.model_runner import ModelRunner


def cpu_timed(cls: type, name: str, into: list[float]) -> None:
    original: Callable = getattr(cls, name)

    def timed(self, *args, **kwargs):
        start = time.thread_time()
        result = original(self, *args, **kwargs)
        into.append(time.thread_time() - start)
        return result

    setattr(cls, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    proposals: list[float] = []
    forwards: list[float] = []
    cpu_timed(EagleProposer, "propose", proposals)
    cpu_timed(ModelRunner, "_forward", forwards)
    spec = {"method": "eagle", "num_speculative_tokens": args.k, "adaptive": False}
    llm = LLM(model=None, max_num_seqs=1, speculative_config=spec)
    prompts = chat_prompts(llm, ["copy", "sort", "add"], 6)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate(prompts[:1], params, use_tqdm=False, add_special_tokens=False)  # warm up
    proposals.clear()
    forwards.clear()
    llm.generate(prompts, params, use_tqdm=False, add_special_tokens=False)
    stats = llm.get_stats().scheduler.spec_decode
    propose_ms = 1e3 * statistics.median(proposals)
    forward_ms = 1e3 * statistics.median(forwards)
    print(f"k = {args.k}, batch 1, thread CPU time, medians over {len(proposals)} proposals")
    print(f"  target forward (verification)  {forward_ms:6.2f} ms")
    ratio = propose_ms / forward_ms
    print(f"  EAGLE proposal                 {propose_ms:6.2f} ms  ({ratio:.2f} steps)")
    if stats is not None and stats.num_drafts:
        length = 1 + stats.num_accepted_tokens / stats.num_drafts
        bound = length / (1 + ratio)
        print(f"  mean acceptance length {length:.2f}: at most {bound:.2f}x plain decoding")


if __name__ == "__main__":
    main()
