"""One engine's offline run for vs_peers.py, in a process of its own: tokenmill or vLLM, each
under its own Python (vLLM's venv has no tokenmill: the standard library only at the top).

    python worker.py --runner tokenmill|vllm --weights W [--dtype D] [--tokenizer T]
        --batches 1,16,64 --prompt-len P --gen-len G --seed S [--memory]

prints one `RESULT {json}` line. At each batch size an untimed warm-up (8 tokens), then the
timed run (greedy, ignore_eos, the prefix cache emptied first): output tok/s, prefill
included. At B = 1 the decode rate apart: (G - 1) tokens over the B = 1 run's time less that
of the same request with one token generated (median of 3). `--memory` instead loads the
engine with a KV cache of a few MB (beside one sequence's linear-attention state for a hybrid
model) and reports how much its resident memory grew, and the bytes of the weights its model
holds (tokenmill only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

RESULT = "RESULT "
# The --memory probe: a KV cache of one 64-token sequence, sized in blocks (16 tokens each, the
# default) so that it holds that sequence whatever the model's KV width; what grows is the
# weights and the engine's buffers.
KV_PROBE_TOKENS = 64
KV_PROBE_BLOCKS = KV_PROBE_TOKENS // 16


def tree_rss_bytes(pid: int | None = None) -> int:
    """Resident bytes of a process and all its descendants (vLLM runs its model in a child)."""
    pid = os.getpid() if pid is None else pid
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended meanwhile
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def random_prompts(batch: int, prompt_len: int, seed: int, vocab: int) -> list[list[int]]:
    """Ids in [10, vocab): past the special tokens and inside the tokenizer (vLLM refuses ids
    past it), the same for every engine on the same checkpoint."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]


class _Engine:
    """tokenmill's or vLLM's `LLM`, timed through the same few calls. The library is
    imported on construction, the model loaded by `load` (so that the memory probe can
    measure the load alone)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.runner = args, args.runner
        if args.runner == "vllm":
            from vllm import LLM, SamplingParams
        else:
            from tokenmill import LLM, SamplingParams
        self.llm_class, self.params = LLM, SamplingParams

    def load(self, max_num_seqs: int, max_model_len: int, **extra: object) -> None:
        kwargs: dict = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs, **extra}
        if self.args.dtype != "auto":
            kwargs["dtype"] = self.args.dtype
        if self.args.tokenizer:
            kwargs["tokenizer"] = self.args.tokenizer
        self.llm = self.llm_class(model=self.args.weights, **kwargs)

    def float_bytes(self) -> int:
        if self.runner == "vllm":
            return 2  # always run in bfloat16 here
        return self.llm.engine.parts.dtype.itemsize  # the engine's compute dtype

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        """(seconds, tokens generated) for `prompts` at once, the prefix cache emptied."""
        params = self.params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.llm.reset_prefix_cache()
        inputs = [{"prompt_token_ids": p} for p in prompts] if self.runner == "vllm" else prompts
        start = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def worker(args: argparse.Namespace) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    engine = _Engine(args)
    if args.memory:
        from tokenmill.models.weight_bytes import weight_bytes

        # tokenmill only (vLLM's KV space is set in whole GiB). A hybrid model's one sequence
        # also holds its linear layers' state, beside the given blocks; prefix caching off
        # leaves it one slot (no snapshots), as llama.cpp's one recurrent state.
        before = tree_rss_bytes()
        engine.load(1, KV_PROBE_TOKENS, num_kv_blocks=KV_PROBE_BLOCKS, enable_prefix_caching=False)

        model = engine.llm.engine.model
        return {"rss_load_bytes": tree_rss_bytes() - before, "weight_bytes": weight_bytes(model)}
    engine.load(max(batches), args.max_model_len)
    vocab = min(2000, len(engine.llm.get_tokenizer()))
    rates, decode = {}, None
    for batch in batches:
        engine.run(random_prompts(batch, args.prompt_len, 99, vocab), 8)  # warm-up
        prompts = random_prompts(batch, args.prompt_len, args.seed, vocab)
        seconds, tokens = engine.run(prompts, args.gen_len)
        rates[batch] = tokens / seconds
        if batch == 1 and args.gen_len > 1:
            prefill = statistics.median(engine.run(prompts, 1)[0] for _ in range(3))
            if seconds > prefill:
                decode = (args.gen_len - 1) / (seconds - prefill)
    return {"rates": rates, "decode_steps_s": decode, "float_bytes": engine.float_bytes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runner", choices=("tokenmill", "vllm"), required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", action="store_true")
    args = parser.parse_args()
    print(RESULT + json.dumps(worker(args)), flush=True)


if __name__ == "__main__":
    main()
