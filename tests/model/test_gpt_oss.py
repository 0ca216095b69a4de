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


def generate(path: Path, **kwargs) -> list[list[int]]:
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
    return [list(o.outputs[0].token_ids) for o in [*first, *rest]]


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
def test_greedy_equals_transformers_chunked_with_prefix_hits(
    checkpoint: Path, attention_backend: str
) -> None:
    assert generate(checkpoint, attention_backend=attention_backend) == reference(checkpoint)


def test_mxfp4_experts_stay_4_bit_and_equal_transformers_dequantized(mxfp4_checkpoints) -> None:
    quantized, dequantized = mxfp4_checkpoints
    assert generate(quantized) == reference(dequantized)
    llm = LLM(model=str(quantized), dtype="float32", max_model_len=64)
    blocks = [layer.mlp for layer in llm.engine.runner.model.layers]
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


def test_mxfp4_native_products_match_the_expansion() -> None:
    """bfloat16 MXFP4 experts run the native 5-bit products (exact weights, int8-rounded
    activations): close to the float32 expansion, the reference."""
    from tokenmill.kernels.native import native_kernels
    from tokenmill.models.gpt_oss_moe import GptOssExperts, GptOssMoEShape

    if native_kernels() is None:
        pytest.skip("needs the native kernels")
    shape = GptOssMoEShape(64, 2, 1, 64, alpha=1.702, limit=7.0, mxfp4=True)
    experts = GptOssExperts(shape)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, rows, cols in (("gate_up_proj", 128, 64), ("down_proj", 64, 64)):
            weight = torch.randn(2, rows, cols, generator=generator) / 8
            blocks, scales = mxfp4.quantize(weight)
            getattr(experts, f"{name}_blocks").copy_(blocks)
            getattr(experts, f"{name}_scales").copy_(scales)
            getattr(experts, f"{name}_bias").copy_(torch.randn(2, rows, generator=generator) / 10)
    x = torch.randn(3, 64, generator=generator)
    reference = experts.expert(1, x)
    assert experts.native_products(1, x) is None  # float32: the exact expansion
    experts.gate_up_proj_bias.data = experts.gate_up_proj_bias.data.bfloat16()
    experts.down_proj_bias.data = experts.down_proj_bias.data.bfloat16()
    got = experts.expert(1, x.bfloat16())
    assert experts.native_products(1, x.bfloat16()) is not None
    assert torch.allclose(got.float(), reference, atol=0.05 * float(reference.abs().max()))
