"""The shared decoder's layers as one native call per step (the C++ `DecoderStack`), for every
family built on them (models/families/: Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3).

Where it applies (the CPU, one rank, the `cpu` attention backend, every decoder linear one the
native kernels multiply: dense packed, int8 or int4, as each layer's `LinearMethod` says
through `native_linear`; a float32 or bfloat16 KV cache), `LlamaForCausalLM.forward` hands
the embedded tokens to it instead of running its layers one op at a time: per layer that is
~100 torch ops and ~10 waits for OpenMP threads less. An MoE family's `FusedMoE` blocks of
routed experts only run inside it too (`set_moe`: the router, softmax and top-k, then the MoE
kernel's one-job phases, all in the stack's job): a batch-1 step of the qwen3-moe preset made
~25 torch ops and 4 pool jobs per layer in Python before. The layers' modules stay the reference
(and the path for everything else); the stack reads their weights, it holds no copy of the
packed linears. With LoRA (lora/model_manager.py) each adapter row's delta is added inside
the stack, after each base product. `TOKENMILL_FUSED_STACK=0` turns it off (A/B measurements).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.moe import ONE_JOB_MAX_PAIRS
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.attention.cpu_backend import CpuPagedAttention
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.linear import Linear
from tokenmill.models.registry import family_of

STACK_CACHE_DTYPES = (torch.float32, torch.bfloat16)


class LlamaDecoderStack:
    def __init__(self, native: Any, max_tokens: int | None = None) -> None:
        """`max_tokens`: the most tokens a step may have to run here (an MoE model's: the
        experts' one-job phases up to `ONE_JOB_MAX_PAIRS` pairs; larger steps run the
        modules, whose kernel takes each expert in turn)."""
        self.native = native
        self.max_tokens = max_tokens
        self.layer_groups: tuple[int, ...] | None = None  # as the native stack was told
        self.lora_mapping: Any = None  # multi-LoRA's per-step rows (lora/layer.py), if any

    def use_lora(self, mapping: Any, layers: list[list[torch.Tensor | None]]) -> None:
        """Adapters inside the stack: each layer's stacked `(a, bt)` for qkv, o, gate_up and
        down (8 tensors, None where a linear has none), read in place each step, and the
        mapping whose `segment_tensor` says which rows run which slot."""
        self.native.set_lora(layers)
        self.lora_mapping = mapping

    def applies(self, metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        if self.max_tokens is not None and metadata.slot_mapping.shape[-1] > self.max_tokens:
            return False
        return metadata.step is not None and kv_caches[0].dtype in STACK_CACHE_DTYPES

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        layer_groups: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """`layer_groups`: each layer's KV group, where the cache has several."""
        step = metadata.step
        assert step is not None
        slot_mapping, block_tables = metadata.slot_mapping, step.block_tables
        if metadata.kv_groups:  # a hybrid cache: each group's slots and tables, stacked
            groups = [metadata, *metadata.kv_groups]
            slot_mapping = torch.stack([m.slot_mapping for m in groups])
            block_tables = torch.stack([m.step.block_tables for m in groups])  # type: ignore[union-attr]
        if layer_groups != self.layer_groups:
            self.native.set_kv_groups(list(layer_groups or ()))
            self.layer_groups = layer_groups
        return self.native.forward(
            hidden,
            positions,
            kv_caches,
            slot_mapping,
            step.query_start_loc,
            step.seq_lens,
            block_tables,
            None if self.lora_mapping is None else self.lora_mapping.segment_tensor,
        )


def build_decoder_stack(model: nn.Module) -> LlamaDecoderStack | None:
    """The stack running the layers of `model` (a `LlamaForCausalLM`), or None where it does
    not apply."""
    module = native_kernels()
    if module is None or model.tp.size > 1 or os.environ.get("TOKENMILL_FUSED_STACK") == "0":
        return None
    if family_of(model.architecture).model_class is not None:
        return None  # a family's own model class (hybrid layers, models/hybrid.py)
    moe = [_moe_of(layer.mlp, module) for layer in model.stage_layers]
    if family_of(model.architecture).mlp is not None and any(
        spec is None and not layer.dense_mlp
        for spec, layer in zip(moe, model.stage_layers, strict=True)
    ):
        return None  # a family's own MLP that the stack cannot run stays in its module
    linears = [
        _layer_linears(layer, spec is not None)
        for layer, spec in zip(model.stage_layers, moe, strict=True)
    ]
    if any(part is None for part in linears):
        return None
    layers = [_layer_tensors(layer) for layer in model.stage_layers]
    if any(tensors is None for tensors in layers):
        return None
    attention = model.stage_layers[0].self_attn
    cos, signed_sin = model.rotary.tables(torch.float32)
    native = module.DecoderStack(
        layers,
        linears,
        final_norm_of(model),
        cos,
        signed_sin,
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        next(
            (layer.mlp.intermediate_size for layer in model.stage_layers if layer.dense_mlp),
            model.shape.intermediate_size,
        ),
        model.shape.rms_norm_eps,
        model.shape.sliding_window or 0,
    )
    traits = model.traits
    uses_local = [layer.uses_local_rope for layer in model.stage_layers]
    local_cos, local_sin = cos, signed_sin
    if model.local_rotary is not None:
        local_cos, local_sin = model.local_rotary.tables(torch.float32)
    native.set_family_options(
        local_cos,
        local_sin,
        uses_local,
        [layer.self_attn.attn.sliding_window or 0 for layer in model.stage_layers],
        attention.attn.scale,
        traits.activation == "gelu_tanh",
    )
    if traits.attention_softcap is not None:
        native.set_attention_softcap(traits.attention_softcap)
    native.set_final_norm(model.stage.is_last)  # a stage before the last hands on the sum
    max_tokens = None
    for index, spec in enumerate(moe):
        if spec is not None:
            experts, router, top_k, renormalize = spec
            native.set_moe(index, experts, router, top_k, renormalize)
            max_tokens = min(max_tokens or ONE_JOB_MAX_PAIRS, ONE_JOB_MAX_PAIRS // top_k)
    return LlamaDecoderStack(native, max_tokens)


def _moe_of(mlp: nn.Module, module: Any) -> tuple[Any, torch.Tensor, int, bool] | None:
    """A `FusedMoE` block the stack runs (routed experts only, every expert's linears with a
    native product) as (native `MoEExperts`, float32 router, top_k, renormalize); else None."""
    if type(mlp) is not FusedMoE or mlp.shared_expert is not None:
        return None
    gate_up = [_native_linear(expert.gate_up_proj) for expert in mlp.experts]
    down = [_native_linear(expert.down_proj) for expert in mlp.experts]
    if any(linear is None or isinstance(linear, list) for linear in [*gate_up, *down]):
        return None
    experts = module.MoEExperts(gate_up, down, mlp.experts[0].intermediate_size)
    router = mlp.gate.weight.detach().float().contiguous()
    return experts, router, mlp.shape.top_k, mlp.shape.renormalize


def _native_linear(linear: nn.Module) -> Any:
    """`linear`'s native product (a `PackedLinear`, a list of parts, or None: no native one)."""
    return linear.quant_method.native_linear(linear)


def final_norm_of(model: nn.Module) -> torch.Tensor:
    """The final norm's scale; on a pipeline stage before the last (which has none) ones of
    the hidden states' dtype, for the stack's width and dtype only."""
    if model.stage.is_last:
        return model.norm.scale().detach()
    return torch.ones(
        model.shape.hidden_size, dtype=model.stage_layers[0].input_layernorm.weight.dtype
    )


def _layer_linears(layer: nn.Module, moe: bool = False) -> list[Any] | None:
    """A `LlamaDecoderLayer`'s qkv, o, gate_up and down, each a list of native `PackedLinear`
    parts (one, or one per format of a mixed layer: mixed_parts.py); None if one's method has
    none. `moe`: the MLP is an MoE block (set_moe), no gate_up / down parts."""
    attention, mlp = layer.self_attn, layer.mlp
    linears = (attention.qkv_proj, attention.o_proj)
    if not moe:
        linears = (*linears, mlp.gate_up_proj, mlp.down_proj)
    if not all(isinstance(linear, Linear) for linear in linears):
        return None
    native = [_native_linear(linear) for linear in linears]
    if any(part is None for part in native):
        return None
    parts = [part if isinstance(part, list) else [part] for part in native]  # lists of parts
    return parts if not moe else [*parts, [], []]


def _layer_tensors(layer: nn.Module) -> list[torch.Tensor | None] | None:
    """A `LlamaDecoderLayer`'s norms and biases in `DecoderStack`'s order; None if the
    attention is not the cpu backend."""
    attention, mlp = layer.self_attn, layer.mlp
    if not isinstance(attention.attn, CpuPagedAttention):
        return None
    qkv, o = attention.qkv_proj, attention.o_proj
    gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)

    def scale_of(norm: nn.Module | None) -> torch.Tensor | None:
        return None if norm is None else norm.scale().detach()

    tensors = [
        scale_of(layer.input_layernorm),
        qkv.bias,
        scale_of(attention.q_norm),
        scale_of(attention.k_norm),
        o.bias,
        scale_of(layer.post_attention_layernorm),
        None if gate_up is None else gate_up.bias,
        None if down is None else down.bias,
    ]
    if layer.pre_feedforward_layernorm is None:
        return tensors
    # Gemma's sandwich: the MLP's input norm in the post-attention slot, then the output norms.
    tensors[5] = scale_of(layer.pre_feedforward_layernorm)
    return [
        *tensors,
        scale_of(layer.post_attention_layernorm),
        scale_of(layer.post_feedforward_layernorm),
    ]
