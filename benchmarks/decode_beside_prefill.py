"""Does work on the other core slow a one-core decode? Decode steps of 32 streams on CPU 0
(an in-process engine, float32 SmolLM2-135M-shaped, 64-token prompts; fresh streams for every
run, so that each times the same context lengths), timed for `--seconds`
while CPU 1 is idle, runs 4,000-token prefills in another engine process, or runs a load like
the disaggregated decode instance's KV receiver (copies, CRC-32s and scatters of 737 KB blocks)
in a thread of the decode process; the configurations interleaved, `--rounds` times.

    python benchmarks/decode_beside_prefill.py [--rounds 2] [--seconds 15]

Needs two CPUs. Prints each run's step median, p90 and max (ms).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import threading
import time
import zlib
from collections.abc import Callable

from itl_under_prefill import smollm2_shaped_model

STREAMS, STREAM_PROMPT, LONG_PROMPT = 32, 64, 4000


def pin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    import torch

    torch.set_num_threads(1)


def receiver_load(stop: Callable[[], bool]) -> None:
    """What the decode instance's KV receiver does per 16 MB chunk, over and over."""
    import torch

    pin(1)
    payload = torch.randint(0, 255, (30, 2, 22, 16, 3, 256), dtype=torch.uint8)
    cache = torch.zeros(2, 2000, 16, 3, 256, dtype=torch.uint8)
    ids = torch.arange(100, 122)
    while not stop():
        staging = payload.clone()
        for block in range(staging.shape[2]):
            zlib.crc32(staging[:, :, block].contiguous().numpy())
        for layer in range(staging.shape[0]):
            cache[:, ids] = staging[layer]


def prefills(ready: mp.Event) -> None:
    pin(1)
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=str(smollm2_shaped_model()), dtype="float32", max_model_len=8192,
              max_num_seqs=1, enable_prefix_caching=False)  # fmt: skip
    rng = random.Random(1)
    ready.set()
    while True:
        prompt = [rng.randrange(10, 40000) for _ in range(LONG_PROMPT)]
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)


def decode_steps(engine, seconds: float) -> list[float]:
    times = []
    end = time.time() + seconds
    while time.time() < end:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    pin(0)
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=str(smollm2_shaped_model()), dtype="float32", max_model_len=2048,
              max_num_seqs=STREAMS)  # fmt: skip
    rng = random.Random(0)
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)

    def fresh_streams(tag: str) -> list[str]:
        """32 new streams past their prompts: every run times the same context lengths."""
        ids = [f"{tag}-{index}" for index in range(STREAMS)]
        for request_id in ids:
            prompt = [rng.randrange(10, 40000) for _ in range(STREAM_PROMPT)]
            llm.engine.add_request(request_id, prompt, params)
        for _ in range(8):
            llm.engine.step()
        return ids

    for round_index in range(args.rounds):
        for name in ("idle", "prefills", "receiver load"):
            stop = threading.Event()
            process = thread = None
            if name == "prefills":
                ready = mp.get_context("spawn").Event()
                process = mp.get_context("spawn").Process(target=prefills, args=(ready,))
                process.start()
                ready.wait()
            elif name == "receiver load":
                thread = threading.Thread(target=receiver_load, args=(stop.is_set,))
                thread.start()
            streams = fresh_streams(f"{round_index}-{name}")
            times = decode_steps(llm.engine, args.seconds)
            llm.engine.abort_request(streams)
            stop.set()
            if process is not None:
                process.terminate()
                process.join()
            if thread is not None:
                thread.join()
            print(
                f"round {round_index} CPU 1 {name}: {len(times)} steps, median "
                f"{statistics.median(times) * 1000:.1f} ms, p90 "
                f"{times[int(0.9 * len(times))] * 1000:.1f}, max {times[-1] * 1000:.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
