"""What the compiled CPU decode step costs at start and buys after: first and second start.

    python benchmarks/compile_start.py [--rounds 2] [--prompt-len 128] [--gen-len 128]

Each configuration runs in a fresh process (a start), in turn, `--rounds` times: the eager
engine (`enforce_eager=True`, the CPU default), the compiled one on an empty inductor cache
(`TORCHINDUCTOR_CACHE_DIR` a new directory: the first start on a machine), and the compiled
one again on the cache the first left (a restart). Each process builds `LLM` (SmolLM2-135M-
shaped model, `max_model_len=512`), then generates one request (`--prompt-len` random tokens,
`--gen-len` new, greedy) twice: the first includes compiling every key it meets, the second is
the steady rate. Prints one JSON line per process: wall and CPU seconds of the first
generate, the seconds the decode step spent compiling, how many keys, the second generate's
tokens/s, and whether both produced the same tokens as the eager engine's first round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CHILD = """
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from make_smollm_shaped_model import model_dir
from tokenmill import LLM, SamplingParams
eager, prompt_len, gen_len = sys.argv[2] == "eager", int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=str(model_dir()), dtype="float32", max_model_len=512, enforce_eager=eager)
rng = random.Random(0)
prompt = [rng.randrange(10, llm.engine.vocab_size) for _ in range(prompt_len)]
params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
runs = []
for _ in range(2):
    llm.reset_prefix_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    runs.append((time.perf_counter() - wall, time.process_time() - cpu, tokens))
step = llm.engine.runner.decode_step
print(json.dumps({
    "first_generate_wall_s": round(runs[0][0], 1),
    "first_generate_cpu_s": round(runs[0][1], 1),
    "compile_wall_s": round(step.capture_seconds, 1) if step else 0.0,
    "keys": len(step.steps) if step else 0,
    "steady_tok_s": round(gen_len / runs[1][0], 2),
    "steady_cpu_ms_per_token": round(runs[1][1] / gen_len * 1e3, 1),
    "tokens": runs[0][2] if runs[0][2] == runs[1][2] else None,
}))
"""


def start(mode: str, cache: Path, prompt_len: int, gen_len: int) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    command = [sys.executable, "-c", _CHILD, str(Path(__file__).parent), mode]
    command += [str(prompt_len), str(gen_len)]
    begin = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-4000:])
    return json.loads(result.stdout.splitlines()[-1]) | {
        "process_wall_s": round(time.perf_counter() - begin, 1)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    args = parser.parse_args()
    reference = None
    for round_index in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            for name, mode in (
                ("eager", "eager"),
                ("first start", "compiled"),
                ("restart", "compiled"),
            ):
                row = start(mode, Path(cache), args.prompt_len, args.gen_len)
                tokens = row.pop("tokens")
                reference = reference or tokens
                row["same_tokens_as_eager"] = tokens is not None and tokens == reference
                print(json.dumps({"round": round_index, "start": name, **row}), flush=True)


if __name__ == "__main__":
    main()
