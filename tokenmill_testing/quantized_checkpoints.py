"""Reference checkpoints for quantization tests: a float checkpoint whose decoder linear
weights are replaced by their dequantized values, so that a float model (transformers', or
tokenmill's without quantization) computes what a quantized engine should."""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tokenmill.kernels.int_linear import activation_level
from tokenmill.kernels.native import native_kernels, using_isa
from tokenmill.sampling_params import SamplingParams
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 10
# 40, 70: prefills of at least 32 rows (the AMX path where the CPU has it: quant_amx_min_rows).
PROMPT_LENS = [1, 6, 19, 40, 70]
# |logprob - reference| allowed (and under which two tokens count as tied), by how the
# quantized product runs: the native kernels with float activations compute the dequantized
# model's product in float32 (measured 0.000-0.004); torch's int8/int4 ops (no native
# kernels) round inputs and outputs to bfloat16 (0.04-0.16); int8 activations (VNNI: W8A8,
# rounded per token and block of 32, as llama.cpp's q8_0 activations) measured 0.10-0.45 on
# the random checkpoints, whose logits (std 4 and more) magnify a relative error of ~0.2 %.
TOLERANCE = {"float": 0.02, "torch": 0.25, "int8": 0.6}
LOGPROB_TOLERANCE = TOLERANCE["torch"]
ACTIVATION_PATHS = ("float", "int8")

# The decoder's linear weights, as Hugging Face checkpoints name them.
DECODER_LINEAR = re.compile(
    r"layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down|qkv|gate_up)_proj\.weight$"
)  # Phi-3 stores q/k/v and gate/up fused: rows quantize alike either way
# The LM head and the embedding (one tensor when tied).
HEAD_WEIGHTS = ("lm_head.weight", "model.embed_tokens.weight")


def copy_checkpoint_files(source: Path, destination: Path) -> None:
    """Everything but the weights: config, generation config, tokenizer files."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copyfile(path, destination / path.name)


def save_dequantized_checkpoint(
    source: Path,
    destination: Path,
    round_trip: Callable[[str, torch.Tensor], torch.Tensor],
    head_round_trip: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Path:
    """`source` with every decoder linear weight `w` (named `name`) replaced by
    `round_trip(name, w)` (quantize then dequantize), and the LM head and embedding by
    `head_round_trip(w)` where given, in float32."""
    copy_checkpoint_files(source, destination)
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if DECODER_LINEAR.search(name):
                tensors[name] = round_trip(name, tensor.float()).contiguous()
            elif head_round_trip is not None and name in HEAD_WEIGHTS:
                tensors[name] = head_round_trip(tensor.float()).contiguous()
        save_file(tensors, destination / file.name, metadata={"format": "pt"})
    return destination


@contextmanager
def activation_path(path: str) -> Iterator[float]:
    """Run the quantized kernels with float (`path` "float") or int8 activations inside the
    block; yields the tolerance of the path in use (the torch ops' where there are no native
    kernels). A path this CPU cannot run raises `Unavailable`."""
    module = native_kernels()
    if module is None:
        if path == "int8":
            raise Unavailable("no native kernels here")
        yield TOLERANCE["torch"]
        return
    level = activation_level(module.detect_isa(), quantized=path == "int8")
    if level is None:
        raise Unavailable("this CPU has no AVX2 or VNNI int8 kernels")
    with using_isa(level):
        yield TOLERANCE[path]


def float_path_is_only_portable() -> bool:
    """Whether this CPU's float-activation kernels are only the portable scalar ones (an AVX2
    machine without AVX-512: its SIMD path quantizes the activations), while the int8 path
    runs SIMD: a test parametrized over both paths then skips the float one (~5x slower, and
    run on machines with AVX-512)."""
    module = native_kernels()
    if module is None:
        return False
    best = module.detect_isa()
    return activation_level(best, quantized=False) == 0 and best > 0


class Unavailable(RuntimeError):
    """A kernel path this machine cannot run (tests skip)."""


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def reference_run(checkpoint: Path, prompts: list[list[int]]):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return greedy_reference(model, prompts, MAX_TOKENS)


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def reference_logprobs(checkpoint: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 log-probabilities after every token of each sequence (one
    forward each: teacher-forced), `[len(sequence), vocab]`."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
            for seq in sequences
        ]


def compare_with_reference(
    llm: object, reference_dir: Path, prompts: list[list[int]], tolerance: float
) -> float:
    """Generate greedily (top-3 logprobs) and score the engine's own sequences with the
    reference model, teacher-forced, so that every generated position compares (a free-run
    reference parts from the engine at its first near-tie and compares nothing after it).
    Asserts that each greedy token is the reference's choice, or within `tolerance` of it (a
    tie); returns max |logprob - reference| over the top tokens of every position."""
    outputs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    references = reference_logprobs(reference_dir, sequences)
    max_diff = 0.0
    for prompt, output, ref in zip(prompts, outputs, references, strict=True):
        completion = output.outputs[0]
        for step, (token, logprobs) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            expected = ref[len(prompt) - 1 + step]
            margin = (expected.max() - expected[token]).item()
            assert margin < tolerance, f"step {step}: greedy token {token} {margin:.3f} below"
            for candidate, logprob in logprobs.items():
                diff = abs(logprob.logprob - expected[candidate].item())
                max_diff = max(max_diff, diff)
    return max_diff
