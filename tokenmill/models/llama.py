"""The shared decoder over flat tokens and a paged KV cache: the Llama layer, with the switches
other families need (`ArchitectureTraits`, models/traits.py; each family's module in
models/families/ sets them from its config).

The model never sees requests or padding: it takes `[num_tokens]` token ids with their
positions and the step's attention metadata, and returns hidden states; logits are computed
only for the rows the runner will sample from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ConfigError
from tokenmill.layers.attention.base import AttentionMetadata, KVCache
from tokenmill.layers.attention.selector import make_attention_backend
from tokenmill.layers.linear import Linear
from tokenmill.layers.parallel import SINGLE, TensorParallel, VocabParallelEmbedding
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary_, rope_parameters
from tokenmill.models.pipeline_split import WHOLE, PipelineStage, PPMissingLayer
from tokenmill.models.registry import family_of
from tokenmill.models.traits import ArchitectureTraits

if TYPE_CHECKING:
    from tokenmill.models.llama_stack import LlamaDecoderStack

# (cos, sin) of each token's position, `[num_tokens, 1, head_dim]`, shared by all layers.
RopeCache = tuple[torch.Tensor, torch.Tensor]


def architecture_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    """The traits its family (models/families/) reads from the config."""
    return family_of(architecture).traits(architecture, hf_config)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelShape:
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(hf_config),
        )


def _sliding_window(hf_config: Any) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    if hasattr(hf_config, "use_sliding_window"):
        # Qwen2/Qwen3: off, or on for the layers their family's traits give (layer_windows).
        return None
    return int(window)


class RMSNorm(nn.Module):
    """Scales by `offset + weight` (Gemma stores its weights around 0: offset 1)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size) if offset == 0.0 else torch.zeros(size))
        self.eps = eps
        self.offset = offset

    def scale(self) -> torch.Tensor:
        """What the normed rows are multiplied by."""
        return self.weight if self.offset == 0.0 else self.weight + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One call instead of six ops; bit-identical to transformers' LlamaRMSNorm in float32.
        return F.rms_norm(x, self.weight.shape, self.scale(), self.eps)


class LlamaAttention(nn.Module):
    """This rank's heads: q/k/v column-parallel, o row-parallel (its bias on rank 0 only, so
    the all-reduce adds it once)."""

    def __init__(
        self,
        shape: ModelShape,
        traits: ArchitectureTraits,
        tp: TensorParallel,
        attention_backend: str = "torch",
        sliding_window: int | None = None,
    ) -> None:
        """`sliding_window`: this layer's own, where layers differ (Gemma 3)."""
        super().__init__()
        self.tp = tp
        self.num_heads = tp.split(shape.num_heads, "number of attention heads")
        self.num_kv_heads = tp.kv_heads(shape.num_kv_heads)[0]
        self.head_dim = shape.head_dim
        self.q_size = self.num_heads * shape.head_dim
        self.kv_size = self.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(
            shape.hidden_size, self.q_size + 2 * self.kv_size, bias=traits.qkv_bias
        )
        o_bias = traits.o_proj_bias and tp.rank == 0
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=o_bias)
        eps, offset = shape.rms_norm_eps, traits.norm_offset
        self.q_norm = RMSNorm(shape.head_dim, eps, offset) if traits.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, eps, offset) if traits.qk_norm else None
        self.attn = make_attention_backend(
            attention_backend,
            self.num_heads,
            self.num_kv_heads,
            shape.head_dim,
            scale=traits.attention_scale or shape.head_dim**-0.5,
        )
        self.attn.sliding_window = sliding_window
        if traits.attention_softcap is not None:
            if attention_backend == "triton":
                raise ConfigError(
                    "attention logit soft-capping (Gemma 2) runs on the cpu and torch attention "
                    "backends, not triton"
                )
            self.attn.softcap = traits.attention_softcap
        self.sinks: nn.Parameter | None = None
        if traits.attention_sinks:
            if attention_backend == "triton":
                raise ConfigError(
                    "attention sinks (gpt-oss) run on the cpu and torch attention backends, "
                    "not triton"
                )
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
            self.attn.sinks = self.sinks

    def forward(
        self,
        rope: RopeCache,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Queries, keys and values stay in the QKV projection's output: RoPE rotates queries
        and keys there together, in place, and keys with values go to the cache as one
        `[num_tokens, 2, kv_heads, head_dim]` view."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            k = qkv[:, self.q_size : self.q_size + self.kv_size]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        qk = qkv[:, : self.q_size + self.kv_size]
        apply_rotary_(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        kv = qkv[:, self.q_size :].view(num_tokens, 2, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, kv, kv_cache, metadata)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


class LlamaMLP(nn.Module):
    """gate/up column-parallel, down row-parallel (bias on rank 0 only)."""

    def __init__(self, shape: ModelShape, traits: ArchitectureTraits, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = tp.split(shape.intermediate_size, "intermediate_size")
        self.gate_up_proj = nn.Linear(
            shape.hidden_size, 2 * self.intermediate_size, bias=traits.mlp_bias
        )
        down_bias = traits.mlp_bias and tp.rank == 0
        self.down_proj = nn.Linear(self.intermediate_size, shape.hidden_size, bias=down_bias)
        self.activation = traits.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        if self.activation == "gelu_tanh":
            return self.tp.all_reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class LlamaDecoderLayer(nn.Module):
    """Llama's pre-norm layer; with `traits.sandwich_norms` Gemma's, whose attention and MLP
    outputs are normed too (post_attention_layernorm is then the attention's output norm and
    pre_feedforward_layernorm the MLP's input norm, as the checkpoints name them)."""

    def __init__(
        self,
        shape: ModelShape,
        traits: ArchitectureTraits,
        tp: TensorParallel,
        attention_backend: str = "torch",
        layer_index: int = 0,
        mlp: nn.Module | None = None,
    ) -> None:
        """`mlp`: the layer's feed-forward block, built by its family's `Family.mlp` (None: a
        dense `LlamaMLP`)."""
        super().__init__()
        hidden, eps, offset = shape.hidden_size, shape.rms_norm_eps, traits.norm_offset
        windows = traits.layer_windows
        window = windows[layer_index] if windows is not None else None
        self.uses_local_rope = window is not None and traits.local_rope is not None
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        self.self_attn = LlamaAttention(shape, traits, tp, attention_backend, window)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        sandwich = traits.sandwich_norms
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset) if sandwich else None
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset) if sandwich else None
        self.mlp = mlp if mlp is not None else LlamaMLP(shape, traits, tp)
        self.dense_mlp = mlp is None  # the fused stack computes exactly this MLP (llama_stack.py)

    def forward(
        self,
        rope: RopeCache,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, metadata)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden = hidden + attended
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoint, except that q/k/v and gate/up are
    stored fused (`qkv_proj`, `gate_up_proj`): one matmul instead of three or two. `shape` is
    the whole model's; under tensor parallelism the modules hold this rank's shard (`tp`)."""

    def __init__(
        self,
        hf_config: Any,
        architecture: str,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        attention_backend: str = "torch",
        max_model_len: int | None = None,
        stage: PipelineStage = WHOLE,
    ) -> None:
        """`attention_backend`: every layer's (resolved: torch, cpu or triton).
        `max_model_len`: the longest sequence served, which the RoPE tables cover (None: the
        config's max_position_embeddings; a config may claim far more than is served).
        `stage`: the pipeline stage this rank runs (models/pipeline_split.py): its layers only."""
        super().__init__()
        self.architecture = architecture
        family = family_of(architecture)
        self.traits = traits = family.traits(architecture, hf_config)
        shape = ModelShape.from_hf_config(hf_config)
        if getattr(hf_config, "use_sliding_window", False) and family.name != "llama":
            raise ConfigError(
                f"use_sliding_window is served for Qwen2 and Qwen3, not {architecture}"
            )
        if traits.layer_windows is not None:  # each layer has its own (attention.sliding_window)
            shape = replace(shape, sliding_window=None)
        self.shape = shape
        self.tp = tp
        positions = min(shape.max_position, max_model_len or shape.max_position)
        rope = traits.rope or rope_parameters(hf_config)
        self.rotary = RotaryEmbedding(shape.head_dim, positions, rope, dtype)
        self.local_rotary = None
        if traits.local_rope is not None:
            self.local_rotary = RotaryEmbedding(shape.head_dim, positions, traits.local_rope, dtype)
        if stage.size > 1 and traits.layer_windows is not None:
            raise ConfigError("pipeline parallelism does not support per-layer windows (Gemma 3)")
        self.stage = stage
        self.stage_start, self.stage_end = start, end = stage.layer_range(shape.num_layers)
        if stage.size > 1:  # the KV cache holds this stage's layers only
            self.num_kv_layers = end - start
        holds_embedding = stage.is_first or (stage.is_last and shape.tie_word_embeddings)
        self.embed_tokens: nn.Module = (
            VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, tp)
            if holds_embedding
            else PPMissingLayer()
        )
        self.layers = nn.ModuleList(
            PPMissingLayer()
            if not start <= i < end
            else LlamaDecoderLayer(
                shape,
                traits,
                tp,
                attention_backend,
                i,
                family.mlp(shape, traits, tp, i, hf_config) if family.mlp else None,
            )
            for i in range(shape.num_layers)
        )
        self.norm: nn.Module = PPMissingLayer()
        self.lm_head: nn.Module = PPMissingLayer()
        if stage.is_last:
            self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, traits.norm_offset)
            vocab_rows = tp.vocab_range(shape.vocab_size)[1]
            self.lm_head = nn.Linear(shape.hidden_size, vocab_rows, bias=False)
            if shape.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        # The layers as one native call (models/llama_stack.py), set once the weights are in.
        self.decoder_stack: LlamaDecoderStack | None = None
        # Each layer's KV group where the runner keeps several (layers/kv_groups.py).
        self.kv_layer_groups: tuple[int, ...] | None = None

    def intermediate_size_of(self, target: str) -> int:
        """The whole (unsharded) width of the MLP that parameter `target` (`layers.{i}.mlp.
        [experts.{e}.]gate_up_proj.weight`) belongs to: its module's slice times the ranks
        (an MoE's experts and shared expert have their own widths)."""
        owner = self.get_submodule(target.rsplit(".", 2)[0])
        rank_width = getattr(owner, "intermediate_size", None)
        return self.shape.intermediate_size if rank_width is None else rank_width * self.tp.size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`hidden_states`: on a pipeline stage after the first, the previous stage's output
        (instead of the embedded `input_ids`); a stage before the last returns its layers'
        output, not normed."""
        hidden = hidden_states
        if hidden is None:
            hidden = self.embed_tokens(input_ids)
            if self.traits.embedding_scale is not None:
                # As transformers: the scale rounded to the weights' dtype first.
                hidden = hidden * torch.tensor(self.traits.embedding_scale, dtype=hidden.dtype)
        if self.decoder_stack is not None and self.decoder_stack.applies(metadata, kv_caches):
            return self.decoder_stack(hidden, positions, kv_caches, metadata, self.kv_layer_groups)
        rope = self.rotary.cos_sin(positions)
        local_rope = rope if self.local_rotary is None else self.local_rotary.cos_sin(positions)
        groups = self.kv_layer_groups
        for index, (layer, kv_cache) in enumerate(zip(self.stage_layers, kv_caches, strict=True)):
            layer_rope = local_rope if layer.uses_local_rope else rope
            layer_metadata = metadata if groups is None else metadata.of_group(groups[index])
            hidden = layer(layer_rope, hidden, kv_cache, layer_metadata)
        return self.norm(hidden) if self.stage.is_last else hidden

    @property
    def stage_layers(self) -> list[LlamaDecoderLayer]:
        """The decoder layers this rank runs: all, or its pipeline stage's."""
        return list(self.layers[self.stage_start : self.stage_end])

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank attends with (and caches)."""
        return self.tp.kv_heads(self.shape.num_kv_heads)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every rank gets the whole vocabulary's logits (all-gathered, padding cut off)."""
        head = self.lm_head
        logits = head.forward_float32(hidden) if isinstance(head, Linear) else head(hidden).float()
        logits = self.tp.all_gather(logits)
        logits = logits[:, : self.shape.vocab_size] if self.tp.size > 1 else logits
        cap = self.traits.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
