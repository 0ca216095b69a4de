"""The hybrid layers' input products merged at load (models/gated_deltanet.py `merge_linears`):
the merged product equals its parts side by side, bit for bit, and a Qwen3.5 model loads with
them merged, its greedy tokens those of the parts (`TOKENMILL_FUSED_HYBRID=0`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.linear import Linear, PackedLinearMethod
from tokenmill.models.gated_deltanet import merge_linears

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="needs the native kernels")


def packed(rows: int, cols: int, dtype: torch.dtype, bias: bool) -> Linear:
    weight = nn.Parameter(torch.randn(rows, cols).to(dtype), requires_grad=False)
    b = nn.Parameter(torch.randn(rows).to(dtype), requires_grad=False) if bias else None
    layer = Linear(cols, rows, PackedLinearMethod(dtype), bias=b, weight=weight, dtype=dtype)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_merged_product_is_the_parts_side_by_side(
    dtype: torch.dtype, bias: bool, tokens: int
) -> None:
    torch.manual_seed(0)
    parts = [packed(rows, 96, dtype, bias) for rows in (48, 32, 4, 4)]
    merged = merge_linears(parts)
    assert merged is not None and merged.out_features == 88
    x = torch.randn(tokens, 96).to(dtype)
    assert torch.equal(merged(x), torch.cat([part(x) for part in parts], dim=-1))


def test_parts_of_other_methods_stay_apart() -> None:
    dense = nn.Linear(96, 16)
    assert merge_linears([packed(16, 96, torch.float32, False), dense]) is None
    mixed = [packed(16, 96, torch.float32, False), packed(16, 96, torch.bfloat16, False)]
    assert merge_linears(mixed) is None


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
    assert all(layer.linear_attn.in_proj_all is not None for layer in layers[:3])
    assert layers[3].self_attn.qkv_all is not None
    monkeypatch.setenv("TOKENMILL_FUSED_HYBRID", "0")
    llm, parts_tokens = generate(checkpoint, dtype)
    assert llm.engine.model.layers[0].linear_attn.in_proj_all is None
    assert merged_tokens == parts_tokens
