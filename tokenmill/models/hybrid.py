"""Hybrid linear-attention decoders: Qwen3.5 and Qwen3-Next (transformers' `Qwen3_5ForCausalLM`,
`Qwen3NextForCausalLM`). Layers are gated DeltaNet (`linear_attention`, models/gated_deltanet.py)
or gated full attention (`full_attention`, three in four linear by default); norms scale by
(1 + weight); each layer's MLP is the dense gated one or, for Qwen3-Next, an MoE block.

Only the full-attention layers keep KV in the paged cache (`num_kv_layers` of them, in order);
the linear layers keep a fixed-size state per sequence in the `LinearStateCache` the runner
hands the model (`use_state_cache`). docs/hybrid_models.md says what is supported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.gated_delta import fused_hybrid_enabled
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.attention.base import AttentionMetadata, KVCache
from tokenmill.layers.attention.selector import make_attention_backend
from tokenmill.layers.linear_state import LinearStateCache, LinearStateSpec
from tokenmill.layers.parallel import SINGLE, TensorParallel, VocabParallelEmbedding
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary_, rope_parameters
from tokenmill.models.families.qwen_moe import is_sparse_layer, qwen_moe_shape
from tokenmill.models.gated_deltanet import GatedDeltaNet, linear_state_spec
from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP, ModelShape, RMSNorm, RopeCache
from tokenmill.models.merged_products import MergedProducts, merge_products
from tokenmill.models.moe import moe_mlp
from tokenmill.models.traits import ArchitectureTraits

NORM_OFFSET = 1.0  # Qwen3.5 / Qwen3-Next RMSNorm: x * (1 + weight)
QWEN3_NEXT = "Qwen3NextForCausalLM"


def hybrid_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ArchitectureTraits(
        qkv_bias=bias, o_proj_bias=bias, qk_norm=True, norm_offset=NORM_OFFSET
    )


class GatedAttention(nn.Module):
    """Full attention whose output is gated by sigmoid of a second half of q_proj (per head:
    the query, then its gate), with q/k norms and partial RoPE. The checkpoint's q/k/v keep
    their own linears (`q_gate_proj`, `key_proj`, `value_proj`; renamed at load by the
    family), since the shared loader fuses `q_proj`, `k_proj`, `v_proj` at Llama's sizes."""

    def __init__(self, shape: ModelShape, bias: bool, attention_backend: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.head_dim
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.q_gate_proj = nn.Linear(shape.hidden_size, 2 * q_size, bias=bias)
        self.key_proj = nn.Linear(shape.hidden_size, kv_size, bias=bias)
        self.value_proj = nn.Linear(shape.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, shape.hidden_size, bias=bias)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, NORM_OFFSET)
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, NORM_OFFSET)
        self.attn = make_attention_backend(
            attention_backend,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            shape.head_dim**-0.5,
        )
        self.qkv_all: MergedProducts | None = None  # the three products (`after_loading`)

    def after_loading(self) -> None:
        """Before the linears are processed: q|gate, k and v merged where adjacent ones share
        a format (`merge_products`; the parts move into `qkv_all`)."""
        parts = [self.q_gate_proj, self.key_proj, self.value_proj]
        del self.q_gate_proj, self.key_proj, self.value_proj
        self.qkv_all = merge_products(parts, fused_hybrid_enabled())

    def forward(
        self, rope: RopeCache, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        assert self.qkv_all is not None, "after_loading merges the input products"
        tokens = hidden.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_gate, k, v = self.qkv_all(hidden)
        q, gate = q_gate.view(tokens, heads, 2 * dim).split(dim, dim=-1)
        k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
        qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        apply_rotary_(qk, *rope)
        kv = torch.stack([qk[:, self.num_heads :], v], dim=1)
        out = self.attn.forward(qk[:, : self.num_heads].contiguous(), kv, kv_cache, metadata)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


def add_norm(
    hidden: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, its norm): one native call where it builds
    (kernels/csrc/add_rms_norm.cpp; `TOKENMILL_FUSED_HYBRID=0` runs torch's ops), else the
    add and the module. `delta` None: hidden as it is."""
    module = native_kernels()
    if (
        module is not None
        and hasattr(module, "add_rms_norm")
        and hidden.device.type == "cpu"
        and hidden.dtype in (torch.float32, torch.bfloat16)
        and norm.weight.dtype == hidden.dtype
        and (delta is None or delta.dtype == hidden.dtype)
        and fused_hybrid_enabled()
    ):
        delta = None if delta is None else delta.contiguous()
        return module.add_rms_norm(hidden.contiguous(), delta, norm.weight, norm.offset, norm.eps)
    if delta is not None:
        hidden = hidden + delta
    return hidden, norm(hidden)


class HybridDecoderLayer(nn.Module):
    def __init__(self, mixer: nn.Module, mlp: nn.Module, shape: ModelShape) -> None:
        super().__init__()
        eps, hidden = shape.rms_norm_eps, shape.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(hidden, eps, NORM_OFFSET)
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp

    def forward(
        self,
        rope: RopeCache,
        hidden: torch.Tensor,
        pending: torch.Tensor | None,
        kv_cache: KVCache | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, the MLP's output still to be added to it): `pending` is the
        previous layer's, added here with the input norm in one call (`add_norm`)."""
        hidden, normed = add_norm(hidden, pending, self.input_layernorm)
        if self.is_linear:
            mixed = self.linear_attn(normed)
        else:
            assert kv_cache is not None
            mixed = self.self_attn(rope, normed, kv_cache, metadata)
        hidden, normed = add_norm(hidden, mixed, self.post_attention_layernorm)
        return hidden, self.mlp(normed)


class HybridForCausalLM(LlamaForCausalLM):
    """The shared decoder's interface (loading, logits, sharding names) over hybrid layers."""

    def __init__(
        self,
        hf_config: Any,
        architecture: str,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        attention_backend: str = "torch",
        max_model_len: int | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if tp.size > 1:
            raise ValueError(f"{architecture} runs on one rank: use tensor_parallel_size 1")
        self.architecture = architecture
        self.traits = traits = hybrid_traits(architecture, hf_config)
        self.shape = shape = ModelShape.from_hf_config(hf_config)
        self.tp = tp
        positions = min(shape.max_position, max_model_len or shape.max_position)
        self.rotary = RotaryEmbedding(shape.head_dim, positions, rope_parameters(hf_config), dtype)
        self.local_rotary = None
        self.embed_tokens = VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, tp)
        layer_types = list(hf_config.layer_types)
        self.linear_layers = [i for i, kind in enumerate(layer_types) if kind == "linear_attention"]
        self.num_kv_layers = len(layer_types) - len(self.linear_layers)
        moe = moe_mlp(qwen_moe_shape, is_sparse_layer) if architecture == QWEN3_NEXT else None
        layers = []
        for i, kind in enumerate(layer_types):
            if kind == "linear_attention":
                index = self.linear_layers.index(i)
                mixer: nn.Module = GatedDeltaNet(hf_config, index, architecture == QWEN3_NEXT)
            else:
                mixer = GatedAttention(shape, traits.qkv_bias, attention_backend)
            mlp = moe(shape, traits, tp, i, hf_config) if moe is not None else None
            layers.append(HybridDecoderLayer(mixer, mlp or LlamaMLP(shape, traits, tp), shape))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, NORM_OFFSET)
        self.lm_head = nn.Linear(shape.hidden_size, self.embed_tokens.weight.shape[0], bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.decoder_stack = None
        self.state_spec: LinearStateSpec = linear_state_spec(
            hf_config, len(self.linear_layers), dtype
        )

    def after_loading(self) -> None:
        """Called by the loader once the weights are in, before the linears are processed
        (models/loader.py): the layers merge their input products (`merge_products`)."""
        for layer in self.layers:
            (layer.linear_attn if layer.is_linear else layer.self_attn).after_loading()

    def use_state_cache(self, cache: LinearStateCache) -> None:
        """The linear layers read and write their states in `cache`'s slots."""
        for layer in self.layers:
            if layer.is_linear:
                layer.linear_attn.states = cache

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions)
        caches = iter(kv_caches)
        pending = None
        for layer in self.layers:
            cache = None if layer.is_linear else next(caches)
            hidden, pending = layer(rope, hidden, pending, cache, metadata)
        return add_norm(hidden, pending, self.norm)[1]


def split_hybrid_tensor(name: str, read: Any, hf_config: Any) -> Iterator[tuple[str, Any]]:
    """The gated attention's q/k/v keep their own linears (`GatedAttention`); multimodal
    checkpoints' `model.language_model.` prefix is the text model's `model.`."""
    name = name.replace("model.language_model.", "model.")
    if name.startswith(("mtp.", "model.visual.")):
        return  # the multi-token-prediction head and the vision tower are not served
    if ".self_attn." in name:
        name = name.replace(".q_proj.", ".q_gate_proj.")
        name = name.replace(".k_proj.", ".key_proj.").replace(".v_proj.", ".value_proj.")
    yield name, read
