"""Qwen3.5 GGUF files as llama.cpp's converter writes them (`qwen35`, `--no-mtp`): the same
greedy tokens as the checkpoint they were converted from, in float32, with the value heads
the converter tiles across key heads put back (2 key heads, 4 value heads here); quantized
copies of them (the gguf package's writer) keep their blocks in the packed int layouts and
give the greedy tokens of the same file dequantized."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from tokenmill import LLM, SamplingParams
from tokenmill.layers.linear import Linear
from tokenmill.layers.quantized_embedding import QuantizedEmbedding
from tokenmill_testing.gguf_retype import dequantized, retyped
from tokenmill_testing.llamacpp_convert import convert, llama_cpp_available
from tokenmill_testing.quantized_checkpoints import activation_path, greedy, random_prompts

pytestmark = pytest.mark.skipif(
    not llama_cpp_available(), reason="no llama.cpp tree at ~/.cache/tokenmill-anchors"
)
MAX_TOKENS = 8
LINEAR = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_hidden_layers": 4,  # three linear layers, then one full attention
    "head_dim": 16,
}


def generate(model: Path, tokenizer: Path) -> list[list[int]]:
    llm = LLM(
        model=str(model),
        tokenizer=str(tokenizer),
        dtype="float32",
        max_model_len=64,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=7,
        max_num_seqs=4,
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 6, 19, 33)]
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True
    )
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_converted_qwen35_gguf_gives_the_checkpoints_tokens(
    tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory
) -> None:
    checkpoint = tiny_checkpoint("qwen3_5", **LINEAR)
    gguf = convert(
        checkpoint, tmp_path_factory.mktemp("gguf") / "qwen35-f32.gguf", extra_args=("--no-mtp",)
    )
    assert generate(gguf, checkpoint) == generate(checkpoint, checkpoint)


# K-quant-sized (rows of 256): every linear keeps its blocks; 2 key heads, 4 value heads of 64
# (whole groups of 32, so `ssm_out`'s columns regroup a group at a time).
QUANTIZABLE = {**LINEAR, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
QUANTIZABLE.update(linear_key_head_dim=32, linear_value_head_dim=64, num_attention_heads=4)
MIXES = {  # llama.cpp's pure Q8_0, and a Q4_K_M-like mix (Q6_K down projections and embedding)
    "Q8_0": lambda name: Q.Q8_0,
    "Q4_K_M": lambda name: Q.Q6_K if name.startswith(("token_embd", "blk.0.ffn_down")) else Q.Q4_K,
}
EXPECTED_FORMATS = {"Q8_0": {"int8-g32"}, "Q4_K_M": {"int4-g32", "int6-g16"}}


def quantized_copy(source: Path, out: Path, mix: str) -> Path:
    """`source` (floats) with every 2-D tensor but the conv's in `mix`'s types."""
    pick = MIXES[mix]
    return retyped(
        source,
        out,
        lambda name, shape: pick(name) if len(shape) == 2 and "conv" not in name else None,
    )


def engine(model: Path, tokenizer: Path) -> LLM:
    return LLM(
        model=str(model),
        tokenizer=str(tokenizer),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
    )


@pytest.mark.parametrize("mix", list(MIXES))
def test_a_quantized_qwen35_gguf_keeps_its_blocks(
    mix: str, tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Quantized linears (both layer kinds, the MLPs, the tied embedding) in the packed int
    layouts, greedy tokens within the float path's tolerance of the same file dequantized."""
    checkpoint = tiny_checkpoint("qwen3_5", **QUANTIZABLE)
    directory = tmp_path_factory.mktemp("gguf-q")
    floats = convert(checkpoint, directory / "f32.gguf", extra_args=("--no-mtp",))
    quantized = quantized_copy(floats, directory / f"{mix}.gguf", mix)
    reference = dequantized(quantized, directory / f"{mix}-dequantized.gguf")
    with activation_path("float") as tolerance:
        llm = engine(quantized, checkpoint)
        model = llm.engine.runner.model
        linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
        assert {m.quant_method.weight_format for m in linears.values()} == EXPECTED_FORMATS[mix]
        assert any(".linear_attn.out_proj" in n for n in linears)
        assert isinstance(model.embed_tokens, QuantizedEmbedding)
        prompts = random_prompts(llm.engine.vocab_size)
        outputs = llm.generate(prompts, greedy(logprobs=1), use_tqdm=False)
        del llm
        ref = engine(reference, checkpoint)
        sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]
        score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        scored = ref.generate(sequences, score, use_tqdm=False)
    max_diff = 0.0
    for prompt, output, reference_run in zip(prompts, outputs, scored, strict=True):
        completion = output.outputs[0]
        positions = reference_run.prompt_logprobs[len(prompt) :]
        for token, logprobs, expected in zip(
            completion.token_ids, completion.logprobs, positions, strict=True
        ):
            best = max(p.logprob for p in expected.values())
            assert best - expected[token].logprob < tolerance, f"{token}: not the reference's"
            max_diff = max(max_diff, abs(logprobs[token].logprob - expected[token].logprob))
    print(f"{mix}: max |logprob - dequantized reference| = {max_diff:.4f}")
    assert max_diff < tolerance
