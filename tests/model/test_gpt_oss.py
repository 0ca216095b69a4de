"""gpt-oss (models/families/gpt_oss.py) against transformers in float32: greedy tokens equal
with chunked prefill and prefix hits, attention sinks, sliding-window and full layers, YaRN
RoPE, on the native (cpu) and portable (torch) attention backends; an MXFP4 checkpoint held
at 4 bits equal to transformers on its dequantized experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.kernels.native import native_kernels
from tokenmill.models.gpt_oss_moe import GptOssMoE
from tokenmill.quantization import mxfp4
from tokenmill_testing.gpt_oss_checkpoint import write_mxfp4_checkpoint
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 8
CONFIG = {
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 64,
    "sliding_window": 4,  # layer 0 sliding, layer 1 full (the default layer_types)
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 512,
    },
}
PHRASE = [5, 9, 13, 21, 7, 8, 9]
PROMPTS = [PHRASE * 3, [40, 41, 42], [*PHRASE * 2, 77, 78], [300, 12, 901, 33, 64, 2, 18, 5, 7]]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("gpt_oss", **CONFIG)


@pytest.fixture(scope="module")
def mxfp4_checkpoints(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    quantized = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    dequantized = tmp_path_factory.mktemp("gpt-oss-dequantized")
    write_mxfp4_checkpoint(checkpoint, quantized, dequantized)
    return quantized, dequantized


def reference(path: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_reference(model, PROMPTS, MAX_TOKENS)[0]


def generate(path: Path, **kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=7,
        enable_prefix_caching=True,
        **kwargs,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True
    )
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)  # the third then hits its prefix
    rest = llm.generate(PROMPTS[1:], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in [*first, *rest]]


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
def test_greedy_equals_transformers_chunked_with_prefix_hits(
    checkpoint: Path, attention_backend: str
) -> None:
    llm, tokens = generate(checkpoint, attention_backend=attention_backend)
    assert tokens == reference(checkpoint)
    # float32 experts run in the native MoE kernel (biases, clamped SwiGLU) where it builds
    native = native_kernels() is not None
    assert all(layer.mlp.experts.uses_native_kernel == native for layer in model_layers(llm))


def model_layers(llm: LLM) -> list:
    return list(llm.engine.runner.model.layers)


def test_mxfp4_experts_stay_4_bit_and_equal_transformers_dequantized(mxfp4_checkpoints) -> None:
    quantized, dequantized = mxfp4_checkpoints
    llm, tokens = generate(quantized)
    assert tokens == reference(dequantized)
    blocks = [layer.mlp for layer in model_layers(llm)]
    assert all(isinstance(block, GptOssMoE) for block in blocks)
    assert blocks[0].experts.gate_up_proj_blocks.dtype == torch.uint8
    assert not hasattr(blocks[0].experts, "gate_up_proj")


def test_mxfp4_dequantize_matches_transformers(mxfp4_checkpoints) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(mxfp4_checkpoints[0] / "model.safetensors")
    blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    scales = tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [e, in, out]
    ours = mxfp4.dequantize(blocks, scales, torch.float32)  # [e, out, in]
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_sinks_refused_on_triton(checkpoint: Path) -> None:
    from tokenmill.layers.parallel import SINGLE
    from tokenmill.models.llama import LlamaAttention, ModelShape, architecture_traits
    from tokenmill.models.loader import load_hf_config

    hf_config, architecture = load_hf_config(checkpoint)
    traits = architecture_traits(architecture, hf_config)
    with pytest.raises(ConfigError, match=r"attention sinks .* not triton"):
        LlamaAttention(ModelShape.from_hf_config(hf_config), traits, SINGLE, "triton")
