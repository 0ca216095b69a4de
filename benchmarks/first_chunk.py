"""Time to the first chat stream chunk vs. to the first content token, as benchmark clients see it.

vLLM's `bench serve` (and guidellm, aiperf) take the first chunk's arrival as the time to first
token. A server that sends the role chunk on acceptance makes that time look like a queue
round trip, however long the prefill. Against one or more running servers, interleaved:

    python benchmarks/first_chunk.py http://127.0.0.1:8001 http://127.0.0.1:8002 \
        --prompt-words 900 --requests 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx


def one_request(url: str, words: int, salt: int) -> tuple[float, float]:
    """Seconds to the first event and to the first event with content. `salt` starts the
    prompt, so no request finds another's prompt in the prefix cache."""
    prompt = " ".join([str(salt), *["apple banana cherry"] * (words // 3)])
    body = {
        "messages": [{"role": "user", "content": f"Reverse this list: {prompt}"}],
        "max_tokens": 4,
        "stream": True,
    }
    start = time.perf_counter()
    first = first_content = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter() - start
            first = now if first is None else first
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                first_content = now
                break
    assert first is not None and first_content is not None
    return first, first_content


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--prompt-words", type=int, default=900)
    parser.add_argument("--requests", type=int, default=9)
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float]]] = {url: [] for url in args.urls}
    for url in args.urls:
        one_request(url, args.prompt_words, salt=-1)  # warm-up
    for i in range(args.requests):
        for url in args.urls:  # interleaved, so load changes hit every server alike
            times[url].append(one_request(url, args.prompt_words, salt=i))
    for url, samples in times.items():
        first = statistics.median(s[0] for s in samples) * 1000
        content = statistics.median(s[1] for s in samples) * 1000
        print(f"{url}: median first chunk {first:.1f} ms, first content {content:.1f} ms")


if __name__ == "__main__":
    main()
