"""Mixture-of-experts GGUF files as llama.cpp's converter writes them (Mixtral as `llama`
with an expert count, `qwen2moe` with its shared expert, `qwen3moe`): the same greedy tokens
as the Hugging Face checkpoint they were converted from, in float32; llama-quantize's Q8_0
and Q4_K_M experts close."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill_testing.llamacpp_convert import QUANTIZE, convert, llama_cpp_available, quantize

pytestmark = pytest.mark.skipif(
    not llama_cpp_available(), reason="no llama.cpp tree at ~/.cache/tokenmill-anchors"
)
MAX_TOKENS = 8
# llama.cpp converts Qwen3-MoE with every layer sparse (it refuses mlp_only_layers).
FAMILIES = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint(request.param, **FAMILIES[request.param])


@pytest.fixture(scope="module")
def gguf_f32(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(checkpoint, tmp_path_factory.mktemp("gguf") / "model-f32.gguf")


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 6, 19, 33)]


def generate(model: Path, tokenizer: Path, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(model), tokenizer=str(tokenizer), dtype="float32", **kwargs)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True
    )
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def test_converted_gguf_gives_the_checkpoints_tokens(checkpoint: Path, gguf_f32: Path) -> None:
    _, expected = generate(checkpoint, checkpoint)
    llm, got = generate(gguf_f32, checkpoint, block_size=4, max_num_batched_tokens=7)
    model = llm.engine.runner.model
    assert all(isinstance(layer.mlp, FusedMoE) for layer in model.layers)
    assert got == expected


# llama-quantize's type -> the experts' format (Q4_K_M: rows this narrow fall back to Q4_0 /
# Q5_0 and the like, blocks of 32, mixed per tensor as llama.cpp's `_M` recipes do).
QUANTIZED = {"Q8_0": "int8", "Q4_K_M": "int"}


@pytest.mark.skipif(not QUANTIZE.is_file(), reason="no llama-quantize build")
@pytest.mark.parametrize("qtype", sorted(QUANTIZED))
def test_quantized_experts_keep_their_blocks_and_stay_close(
    checkpoint: Path, gguf_f32: Path, tmp_path: Path, qtype: str
) -> None:
    """llama-quantize's experts keep their blocks (integer codes, per-expert slices of the
    stacked tensors); most greedy tokens stay the float file's."""
    quantized = quantize(gguf_f32, tmp_path / f"model-{qtype}.gguf", qtype)
    _, expected = generate(gguf_f32, checkpoint)
    llm, got = generate(quantized, checkpoint)
    block = next(layer.mlp for layer in llm.engine.runner.model.layers)
    fmt = block.experts[0].gate_up_proj.quant_method.weight_format
    assert fmt.startswith(QUANTIZED[qtype]), fmt
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    assert same >= 0.5 * MAX_TOKENS * len(expected)
