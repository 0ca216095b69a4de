"""The hybrid layers' input products merged at load (models/merged_products.py): adjacent
parts of one format (dense float, int8 / int6 groups, int4 groups: a GGUF file's K-quant
blocks load as these) in one product whose output is the parts' side by side, bit for bit,
parts of other formats apart; and a Qwen3.5 model loads with them merged, its greedy tokens
those of the parts (`TOKENMILL_FUSED_HYBRID=0`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.linear import Linear, LinearMethod, PackedLinearMethod
from tokenmill.models.merged_products import merge_products
from tokenmill.quantization.int4 import Int4LinearMethod
from tokenmill.quantization.int8 import Int8GroupWeight, Int8LinearMethod

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="needs the native kernels")

METHODS: dict[str, Callable[[torch.dtype], LinearMethod]] = {
    "packed": PackedLinearMethod,
    "int4-g32": lambda dtype: Int4LinearMethod(32),
    "int8-g32": lambda dtype: Int8LinearMethod(32),
    "int6-g16": lambda dtype: Int8LinearMethod(16, code_bits=6),
}


def loaded(rows: int, cols: int, fmt: str, dtype: torch.dtype, bias: bool) -> Linear:
    """A linear of `fmt` with random weights loaded, not yet processed (as the loader
    leaves it for the model's `after_loading`)."""
    b = nn.Parameter(torch.randn(rows).to(dtype), requires_grad=False) if bias else None
    layer = Linear(cols, rows, METHODS[fmt](dtype), bias=b, dtype=dtype)
    weight: object = torch.randn(rows, cols).to(dtype)
    if fmt == "int6-g16":  # codes within 6 bits and a scale per 16, as a Q6_K file's
        codes = torch.randint(-32, 32, (rows, cols), dtype=torch.int8)
        weight = Int8GroupWeight(codes, torch.rand(rows, cols // 16) / 32)
    layer.quant_method.load_weight(layer, weight, 0)
    return layer


def processed(layers: list[nn.Module]) -> None:
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, Linear):
                module.quant_method.process_weights_after_loading(module)


@pytest.mark.parametrize("fmt", list(METHODS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_merged_product_is_the_parts_side_by_side(
    fmt: str, dtype: torch.dtype, tokens: int
) -> None:
    torch.manual_seed(0)
    bias = fmt == "packed"
    sizes = [48, 32, 4, 4]
    parts = [loaded(rows, 96, fmt, dtype, bias) for rows in sizes]
    reference = [loaded(rows, 96, fmt, dtype, bias) for rows in sizes]
    for part, ref in zip(parts, reference, strict=True):  # the same weights, kept apart
        ref.load_state_dict(part.state_dict())
    merged = merge_products(parts)
    assert len(merged.runs) == 1 and merged.sizes == [sizes]
    processed([merged, *reference])
    x = torch.randn(tokens, 96).to(dtype)
    for got, ref in zip(merged(x), reference, strict=True):
        assert torch.equal(got, ref(x))


def test_parts_of_other_formats_stay_apart() -> None:
    """A Q4_K_M file's Q6_K `attn_qkv` before Q4_K `attn_gate`, `ssm_beta`, `ssm_alpha`:
    two products; a plain module or another dtype breaks a run too; `merge` False keeps
    every part alone."""
    dtype = torch.bfloat16
    formats = ["int6-g16", "int4-g32", "int4-g32", "int4-g32"]
    parts = [loaded(32, 64, fmt, dtype, False) for fmt in formats]
    assert merge_products(parts).sizes == [[32], [32, 32, 32]]
    parts = [loaded(32, 64, fmt, dtype, False) for fmt in formats]
    assert merge_products(parts, merge=False).sizes == [[32]] * 4
    dense = [loaded(16, 64, "packed", torch.float32, False), nn.Linear(64, 16)]
    assert merge_products(dense).sizes == [[16], [16]]
    mixed = [loaded(16, 64, "packed", torch.float32, False), loaded(16, 64, "packed", dtype, False)]
    assert merge_products(mixed).sizes == [[16], [16]]


def generate(checkpoint: Path, dtype: str) -> tuple[LLM, list[list[int]]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (9, 1, 70)]
    llm = LLM(model=str(checkpoint), dtype=dtype, max_model_len=256, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen35_loads_merged_with_the_parts_tokens(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    heads = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "head_dim": 16}
    dims = {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
    checkpoint = tiny_checkpoint("qwen3_5", num_hidden_layers=4, **heads, **dims)
    llm, merged_tokens = generate(checkpoint, dtype)
    layers = llm.engine.model.layers
    assert all(layer.linear_attn.in_proj_all.sizes == [[128, 64, 4, 4]] for layer in layers[:3])
    assert layers[3].self_attn.qkv_all.sizes == [[128, 32, 32]]
    monkeypatch.setenv("TOKENMILL_FUSED_HYBRID", "0")
    llm, parts_tokens = generate(checkpoint, dtype)
    assert len(llm.engine.model.layers[0].linear_attn.in_proj_all.runs) == 4
    assert merged_tokens == parts_tokens
