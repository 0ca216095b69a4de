"""Perplexity of tokenmill and of `llama-perplexity` on the same GGUF file and the same text.

    python -m benchmarks.peers.perplexity [--types Q8_0,Q4_K_M] [--ctx 128] [--chunks 16]

The model is the demo target (a trained 3.5M Llama: tokenmill/demo/weights/target), converted
to GGUF once by llama.cpp's converter (tokenmill/bench/llamacpp.py) and quantized by its
`llama-quantize`; the text is demo stories from a seed the training corpus did not use. Both
score the same tokens the way llama-perplexity does: the text tokenized by llama.cpp (its
server's /tokenize, with the BOS), cut into chunks of `--ctx` tokens whose first token is the
BOS, and the negative log-likelihood of each chunk's second half averaged; PPL = exp(mean).
llama.cpp runs with `--no-repack` (on a VM whose kernel leaves AMX tiles off, its AMX
kernels fault: SIGILL in tilezero).
"""

from __future__ import annotations

import argparse
import math
import random
import re
import subprocess
from pathlib import Path

import httpx

from tokenmill.bench.llamacpp import LlamaServerProcess, gguf_file

LLAMACPP = Path.home() / ".cache" / "tokenmill-anchors" / "llama.cpp"
TEXT_SEED = 2_000_003  # not one of the training corpus's seeds


def demo_target() -> Path:
    import tokenmill

    return Path(tokenmill.__file__).parent / "demo" / "weights" / "target"


def bin_dir(llamacpp: Path) -> Path:
    return llamacpp / "build" / "bin"


def quantized_gguf(llamacpp: Path, qtype: str, out_dir: Path) -> Path:
    """The demo target as a `qtype` GGUF file made by llama-quantize (once per directory)."""
    out = out_dir / f"demo-target-{qtype}.gguf"
    if not out.is_file():
        source = gguf_file(demo_target(), llamacpp, "float32")
        command = [str(bin_dir(llamacpp) / "llama-quantize"), str(source), str(out), qtype]
        subprocess.run(command, check=True, capture_output=True)
    return out


def story_text(num_stories: int) -> str:
    from tokenmill.demo.stories import story

    rng = random.Random(TEXT_SEED)
    return "\n\n".join(story(rng) for _ in range(num_stories))


def llamacpp_tokens(llamacpp: Path, gguf: Path, text: str, log: Path) -> list[int]:
    """The text as llama.cpp tokenizes it for llama-perplexity (the BOS first)."""
    args = ["-m", str(gguf), "-c", "256", "-t", "1", "--no-repack"]
    with LlamaServerProcess(bin_dir(llamacpp), args, log) as server:
        body = {"content": text, "add_special": True}
        reply = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60)
        reply.raise_for_status()
        return reply.json()["tokens"]


def llamacpp_perplexity(
    llamacpp: Path, gguf: Path, text_file: Path, ctx: int, chunks: int
) -> float:
    """llama-perplexity's estimate over the first `chunks` chunks: its running value `[chunks]`
    (PPL so far), with one chunk more run after it. Its last log lines (the final estimate
    among them) are sometimes lost when it exits, even with --log-file; the running value of
    the chunk before the last is always written."""
    log = text_file.with_suffix(f".{gguf.stem}.log")
    command = [str(bin_dir(llamacpp) / "llama-perplexity"), "-m", str(gguf), "-f", str(text_file)]
    command += ["-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks + 1), "-t", "2"]
    command += ["--no-repack", "--log-file", str(log)]
    subprocess.run(command, capture_output=True, text=True, check=True)
    match = re.search(rf"\[{chunks}\]([0-9.]+),", log.read_text())
    if match is None:
        raise RuntimeError(f"no running PPL [{chunks}] in llama-perplexity's log {log}")
    return float(match.group(1))


def tokenmill_perplexity(llm, tokens: list[int], ctx: int, chunks: int) -> float:
    """llama-perplexity's measure: chunks of `ctx` tokens, the first replaced by the BOS,
    the log-likelihood of each token in the chunk's second half given all before it."""
    from tokenmill import SamplingParams

    bos = tokens[0]
    num_chunks = min(chunks, len(tokens) // ctx)
    prompts = [[bos, *tokens[i * ctx + 1 : (i + 1) * ctx]] for i in range(num_chunks)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    nll, count = 0.0, 0
    for prompt, output in zip(prompts, outputs, strict=True):
        for position in range(ctx // 2 + 1, ctx):
            nll -= output.prompt_logprobs[position][prompt[position]].logprob
            count += 1
    return math.exp(nll / count)


def compare(
    llamacpp: Path, qtype: str, work: Path, ctx: int, chunks: int
) -> tuple[float, float, str]:
    """(tokenmill's PPL, llama-perplexity's, tokenmill's weight format) for `qtype`."""
    from tokenmill import LLM

    gguf = quantized_gguf(llamacpp, qtype, work)
    text = story_text(num_stories=max(8, ctx * (chunks + 2) // 90))
    text_file = work / "stories.txt"
    text_file.write_text(text)
    tokens = llamacpp_tokens(llamacpp, gguf, text, work / f"llama-server-{qtype}.log")
    theirs = llamacpp_perplexity(llamacpp, gguf, text_file, ctx, chunks)
    llm = LLM(model=str(gguf), tokenizer=str(demo_target()), max_model_len=ctx + 1, dtype="float32")
    ours = tokenmill_perplexity(llm, tokens, ctx, chunks)
    return ours, theirs, llm.engine.parts.weight_format


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--types", default="Q8_0,Q4_K_M")
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--llamacpp", type=Path, default=LLAMACPP)
    parser.add_argument("--work", type=Path, default=Path("/tmp/tokenmill-perplexity"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print("| file | tokenmill PPL | llama-perplexity PPL | difference | tokenmill weights |")
    print("|---|---|---|---|---|")
    for qtype in args.types.split(","):
        ours, theirs, weights = compare(args.llamacpp, qtype, args.work, args.ctx, args.chunks)
        diff = (ours - theirs) / theirs
        print(f"| {qtype} | {ours:.4f} | {theirs:.4f} | {diff:+.2%} | {weights} |", flush=True)


if __name__ == "__main__":
    main()
