"""gpt-oss GGUF files as llama.cpp's `convert_hf_to_gguf.py` writes them (quantization/
gguf_gpt_oss.py): a float checkpoint's and an MXFP4 checkpoint's conversions give
transformers' greedy tokens in float32 (the MXFP4 one held at 4 bits, its blocks equal to the
checkpoint's after undoing ggml's nibble order)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.model.test_gpt_oss import (
    CONFIG,
    MAX_TOKENS,
    PROMPTS,
    generate,
    model_layers,
    reference,
)
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.native import native_kernels
from tokenmill.quantization.gguf_file import GGUFCheckpoint
from tokenmill_testing.gpt_oss_checkpoint import write_mxfp4_checkpoint
from tokenmill_testing.llamacpp_convert import convert, llama_cpp_available

pytestmark = pytest.mark.skipif(
    not llama_cpp_available(), reason="no llama.cpp tree at ~/.cache/tokenmill-anchors"
)


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """checkpoint, mxfp4 (its experts quantized), dequantized (those expanded back: the
    reference), and the GGUF conversions of the first two."""
    checkpoint = tiny_checkpoint("gpt_oss", **CONFIG)
    paths = {"checkpoint": checkpoint}
    for name in ("mxfp4", "dequantized"):
        paths[name] = tmp_path_factory.mktemp(f"gpt-oss-{name}")
    write_mxfp4_checkpoint(checkpoint, paths["mxfp4"], paths["dequantized"])
    out = tmp_path_factory.mktemp("gpt-oss-gguf")
    with ThreadPoolExecutor(2) as pool:  # the converter's start-up is most of its time
        sources = {"f32.gguf": checkpoint, "mxfp4.gguf": paths["mxfp4"]}
        futures = {name: pool.submit(convert, src, out / name) for name, src in sources.items()}
        paths.update({name: future.result() for name, future in futures.items()})
    return paths


@pytest.mark.parametrize(("gguf", "expected"), [("f32", "checkpoint"), ("mxfp4", "dequantized")])
def test_converted_gguf_equals_transformers(converted, gguf: str, expected: str) -> None:
    llm, tokens = generate(converted[f"{gguf}.gguf"], tokenizer=str(converted["checkpoint"]))
    assert tokens == reference(converted[expected])
    experts = model_layers(llm)[0].mlp.experts
    assert experts.shape.mxfp4 == (gguf == "mxfp4")


def test_mxfp4_blocks_read_back_as_the_checkpoints(converted) -> None:
    gguf = GGUFCheckpoint(converted["mxfp4.gguf"])
    read = dict(gguf.iter_tensors(gguf.linear_formats(), 4, 2))
    theirs = load_file(converted["mxfp4"] / "model.safetensors")
    for name in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks"):
        full = f"model.layers.1.mlp.experts.{name}"
        assert torch.equal(read[full](None), theirs[full]), name


def test_mxfp4_gguf_in_bfloat16_runs_the_native_kernel(converted) -> None:
    """bfloat16: the MXFP4 experts as 5-bit codes in the native MoE kernel
    (activations rounded to int8 per 32): most greedy tokens stay float32's."""
    if native_kernels() is None:
        pytest.skip("needs the native kernels")
    expected = reference(converted["dequantized"])
    # dtype named: "auto" is float32 where the CPU has no native bf16 products (AVX2).
    gguf, tokenizer = str(converted["mxfp4.gguf"]), str(converted["checkpoint"])
    llm = LLM(model=gguf, tokenizer=tokenizer, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    experts = model_layers(llm)[0].mlp.experts
    assert experts.uses_native_kernel and experts.gate_up_proj_blocks is None  # packed, freed
    same = sum(a == b for o, e in zip(outputs, expected) for a, b in zip(o.outputs[0].token_ids, e))
    assert same >= 0.5 * MAX_TOKENS * len(PROMPTS)
