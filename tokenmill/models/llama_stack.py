"""The Llama family's decoder layers as one native call per step (the C++ `DecoderStack`).

Where it applies (the CPU, one rank, the `cpu` attention backend, every decoder linear one the
native kernels multiply: dense packed, int8 or int4, as each layer's `LinearMethod` says
through `native_linear`; a float32 or bfloat16 KV cache), `LlamaForCausalLM.forward` hands
the embedded tokens to it instead of running its layers one op at a time: per layer that is
~100 torch ops and ~10 waits for OpenMP threads less. The layers' modules stay the reference
(and the path for everything else); the stack reads their weights, it holds no copy of the
packed linears. `TOKENMILL_FUSED_STACK=0` turns it off (A/B measurements).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.native import native_kernels
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.attention.cpu_backend import CpuPagedAttention
from tokenmill.layers.linear import Linear

STACK_CACHE_DTYPES = (torch.float32, torch.bfloat16)


class LlamaDecoderStack:
    def __init__(self, native: Any) -> None:
        self.native = native

    @staticmethod
    def applies(metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        return metadata.step is not None and kv_caches[0].dtype in STACK_CACHE_DTYPES

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        step = metadata.step
        assert step is not None
        return self.native.forward(
            hidden,
            positions,
            kv_caches,
            metadata.slot_mapping,
            step.query_start_loc,
            step.seq_lens,
            step.block_tables,
        )


def build_decoder_stack(model: nn.Module) -> LlamaDecoderStack | None:
    """The stack running the layers of `model` (a `LlamaForCausalLM`), or None where it does
    not apply."""
    module = native_kernels()
    if module is None or model.tp.size > 1 or os.environ.get("TOKENMILL_FUSED_STACK") == "0":
        return None
    if not getattr(model, "supports_fused_stack", True):
        return None  # MoE layers (models/moe.py) run as modules
    layers = [_layer_tensors(layer) for layer in model.layers]
    linears = [_layer_linears(layer) for layer in model.layers]
    if any(tensors is None for tensors in layers) or any(part is None for part in linears):
        return None
    attention = model.layers[0].self_attn
    cos, signed_sin = model.rotary.tables(torch.float32)
    native = module.DecoderStack(
        layers,
        linears,
        model.norm.weight.detach(),
        cos,
        signed_sin,
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        model.layers[0].mlp.intermediate_size,
        model.shape.rms_norm_eps,
        model.shape.sliding_window or 0,
    )
    return LlamaDecoderStack(native)


def _layer_linears(layer: nn.Module) -> list[Any] | None:
    """A `LlamaDecoderLayer`'s qkv, o, gate_up and down as native `PackedLinear`s; None if
    one's method has none."""
    attention, mlp = layer.self_attn, layer.mlp
    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(linear, Linear) for linear in linears):
        return None
    native = [linear.quant_method.native_linear(linear) for linear in linears]
    return None if any(part is None for part in native) else native


def _layer_tensors(layer: nn.Module) -> list[torch.Tensor | None] | None:
    """A `LlamaDecoderLayer`'s norms and biases in `DecoderStack`'s order; None if the
    attention is not the cpu backend."""
    attention, mlp = layer.self_attn, layer.mlp
    if not isinstance(attention.attn, CpuPagedAttention):
        return None
    qkv, o, gate_up, down = attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj

    def weight_of(norm: nn.Module | None) -> torch.Tensor | None:
        return None if norm is None else norm.weight.detach()

    return [
        layer.input_layernorm.weight.detach(),
        qkv.bias,
        weight_of(attention.q_norm),
        weight_of(attention.k_norm),
        o.bias,
        layer.post_attention_layernorm.weight.detach(),
        gate_up.bias,
        down.bias,
    ]
