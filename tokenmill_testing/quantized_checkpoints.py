"""Reference checkpoints for quantization tests: a float checkpoint whose decoder linear
weights are replaced by their dequantized values, so that a float model (transformers', or
tokenmill's without quantization) computes what a quantized engine should."""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tokenmill.sampling_params import SamplingParams

MAX_TOKENS = 10
PROMPT_LENS = [1, 6, 19, 40]
# |logprob - reference| under which two tokens count as tied (see agreed_lengths).
LOGPROB_TOLERANCE = 0.25

# The decoder's linear weights, as Hugging Face checkpoints name them.
DECODER_LINEAR = re.compile(r"layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def copy_checkpoint_files(source: Path, destination: Path) -> None:
    """Everything but the weights: config, generation config, tokenizer files."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copyfile(path, destination / path.name)


def save_dequantized_checkpoint(
    source: Path, destination: Path, round_trip: Callable[[str, torch.Tensor], torch.Tensor]
) -> Path:
    """`source` with every decoder linear weight `w` (named `name`) replaced by
    `round_trip(name, w)` (quantize then dequantize), in float32."""
    copy_checkpoint_files(source, destination)
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if DECODER_LINEAR.search(name):
                tensors[name] = round_trip(name, tensor.float()).contiguous()
        save_file(tensors, destination / file.name, metadata={"format": "pt"})
    return destination


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def reference_run(checkpoint: Path, prompts: list[list[int]]):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logprobs.append(torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
    return tokens, logprobs


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def agreed_lengths(
    got: list[list[int]], expected: list[list[int]], ref_logprobs: list[torch.Tensor]
) -> list[int]:
    """How many greedy tokens of each sequence equal the reference's. A sequence may part
    from it only where the reference's own top two are closer than the tolerance (a tie for
    bfloat16 arithmetic; after it the two continue from different tokens, so only the
    tokens up to and including that one compare). Most tokens must match."""
    lengths = []
    for ours, theirs, ref in zip(got, expected, ref_logprobs, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        if same < len(theirs):
            margin = ref[same, theirs[same]] - ref[same, ours[same]]
            assert margin < LOGPROB_TOLERANCE, f"parted at {same} with margin {margin:.3f}"
        lengths.append(same)
    assert sum(lengths) >= 0.75 * sum(len(t) for t in expected)
    return lengths
