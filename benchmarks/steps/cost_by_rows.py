"""What a step costs by its rows on this machine: decode steps of 1-64 rows, and prompts of
64-2,048 tokens alone, for issue 19's SmolLM2-135M-shaped model (fp32, greedy, default
settings). Where the time per row stops falling, steps have turned compute-bound.

    python -m benchmarks.steps cost-by-rows
"""

from __future__ import annotations

import random
import statistics
import time

from tokenmill import SamplingParams
from tokenmill.bench.itl import smollm2_shaped_model
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine

DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
PROMPT_LENGTHS = (2048, 256, 64)


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def median_decode_step(engine: LLMEngine, rows: int, rng: random.Random) -> float:
    """The median of 7 steps of `rows` requests decoding after 64-token prompts."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2000)
    ids = [f"decode-{rows}-{i}" for i in range(rows)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(3, 2048) for _ in range(64)], params)
    for _ in range(3):  # the prompts, then warm-up
        engine.step()
    seconds = statistics.median(timed_step(engine) for _ in range(7))
    engine.abort_request(ids)
    engine.step()
    return seconds


def main() -> None:
    engine = LLMEngine(
        EngineConfig(model=str(smollm2_shaped_model()), dtype="float32", max_model_len=8192)
    )
    rng = random.Random(0)
    for rows in DECODE_ROWS:
        seconds = median_decode_step(engine, rows, rng)
        print(
            f"{rows:3d} decode rows: step {1000 * seconds:7.1f} ms, "
            f"{1000 * seconds / rows:6.1f} ms/row"
        )
    for length in PROMPT_LENGTHS:
        prompt = [rng.randrange(3, 2048) for _ in range(length)]
        engine.add_request(
            f"prompt-{length}", prompt, SamplingParams(temperature=0.0, max_tokens=1)
        )
        seconds = timed_step(engine)
        print(
            f"prompt of {length} alone: {1000 * seconds:.0f} ms, "
            f"{1000 * seconds / length:.2f} ms/token"
        )


if __name__ == "__main__":
    main()
