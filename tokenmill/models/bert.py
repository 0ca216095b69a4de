"""Encoder-only BERT-family models (BERT, XLM-RoBERTa) for pooling: embedders and
cross-encoders.

The encoder attends bidirectionally within each sequence and keeps no KV cache. A step's
tokens stay flat (`[num_tokens, hidden]`) through every linear, so no product is spent on
padding; attention alone takes the sequences apart: on the CPU one native call over the
packed sequences (kernels/encoder_attention.py), elsewhere buckets of similar length.
Parameter names follow the Hugging Face checkpoints, so loading is a name-for-name copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.encoder_attention import (
    cu_seqlens_of,
    encoder_attention_applies,
    native_encoder_attention,
)
from tokenmill.layers.linear import OneDNNLinearMethod

# Architectures this module builds: name -> (checkpoint prefix, classification head kind).
ENCODER_ARCHITECTURES: dict[str, tuple[str, str | None]] = {
    "BertModel": ("", None),
    "XLMRobertaModel": ("", None),
    "RobertaModel": ("", None),
    "BertForSequenceClassification": ("bert.", "bert"),
    "XLMRobertaForSequenceClassification": ("roberta.", "roberta"),
    "RobertaForSequenceClassification": ("roberta.", "roberta"),
}
# In place, on the product's fresh output: a second [tokens, intermediate] buffer cost more
# than the activation itself.
_ACTIVATIONS = {
    "gelu": torch.ops.aten.gelu_,
    "relu": F.relu_,
    "gelu_new": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
}
# oneDNN's GELU fused into the product (OneDNNLinearMethod.apply_then), by hidden_act.
_GELU_ALGORITHMS = {"gelu": "none", "gelu_new": "tanh"}


@dataclass(frozen=True)
class EncoderShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    # RoBERTa-style positions start after the padding index (padding_idx + 1, ...).
    position_offset: int

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> EncoderShape:
        roberta = getattr(hf_config, "model_type", "") in ("roberta", "xlm-roberta")
        kind = getattr(hf_config, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r} is unsupported (absolute only)")
        if hf_config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is unsupported")
        return cls(
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            intermediate_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            max_position=hf_config.max_position_embeddings,
            type_vocab_size=max(int(getattr(hf_config, "type_vocab_size", 1) or 1), 1),
            layer_norm_eps=hf_config.layer_norm_eps,
            hidden_act=hf_config.hidden_act,
            position_offset=(int(hf_config.pad_token_id or 0) + 1) if roberta else 0,
        )

    @property
    def max_tokens(self) -> int:
        """The longest sequence the position table covers."""
        return self.max_position - self.position_offset


class _Embeddings(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.position_embeddings = nn.Embedding(shape.max_position, shape.hidden_size)
        self.token_type_embeddings = nn.Embedding(shape.type_vocab_size, shape.hidden_size)
        self.LayerNorm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)
        self.position_offset = shape.position_offset

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        hidden = hidden + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(hidden)


# A bucket of sequences attends as one padded batch while its padding stays within this
# share of its real tokens.
MAX_PADDING_SHARE = 0.25


@dataclass(frozen=True)
class _Bucket:
    start: int  # its first token in the flat rows
    end: int
    valid: torch.Tensor | None  # [count, longest] real positions; None: no padding
    count: int
    longest: int
    # With padding: each padded slot's row in the bucket (a padding slot repeats its
    # sequence's last token, so keys and values stay finite under the mask), and each real
    # token's slot. One gather in and one out, no zero-filled copy (which cost as much).
    gather: torch.Tensor | None = None  # [count * longest]
    slots: torch.Tensor | None = None  # [end - start]


@dataclass(frozen=True)
class AttentionLayout:
    """How a step's sequences attend: packed, in one native call over `cu_seqlens` (CPU,
    float32 / bfloat16), or else in padded `buckets` through SDPA."""

    cu_seqlens: torch.Tensor | None = None
    buckets: tuple[_Bucket, ...] = ()


def attention_layout(
    lengths: list[int], device: torch.device, dtype: torch.dtype
) -> AttentionLayout:
    if encoder_attention_applies(device, dtype):
        return AttentionLayout(cu_seqlens=cu_seqlens_of(lengths))
    return AttentionLayout(buckets=tuple(attention_buckets(lengths, device)))


def attention_buckets(lengths: list[int], device: torch.device) -> list[_Bucket]:
    """A step's sequences (sorted by length: the runner sorts them) in buckets of similar
    length. Attention is the only part that needs sequences apart; each bucket attends as one
    batch, padded to its longest with a key mask, so padding costs at most a quarter more
    attention, and few calls. (All padded to the step's longest, attention was half the
    forward; one call per sequence, the calls' overhead cost more on a loaded machine.)"""
    buckets: list[_Bucket] = []
    first, tokens, members = 0, 0, []
    for length in [*lengths, None]:
        if members and (
            length is None
            or (len(members) + 1) * length > (1 + MAX_PADDING_SHARE) * (tokens + length)
        ):
            buckets.append(_bucket(first, tokens, members, device))
            first, tokens, members = first + tokens, 0, []
        if length is not None:
            members.append(length)
            tokens += length
    return buckets


def _bucket(first: int, tokens: int, members: list[int], device: torch.device) -> _Bucket:
    longest = max(members)
    if min(members) == longest:
        return _Bucket(first, first + tokens, None, len(members), longest)
    row_lengths = torch.tensor(members)
    column = torch.arange(longest)[None, :]
    valid = column < row_lengths[:, None]
    starts = torch.cumsum(row_lengths, 0) - row_lengths
    gather = (starts[:, None] + torch.minimum(column, row_lengths[:, None] - 1)).reshape(-1)
    slots = valid.reshape(-1).nonzero().squeeze(1)
    return _Bucket(
        first,
        first + tokens,
        valid.to(device),
        len(members),
        longest,
        gather.to(device),
        slots.to(device),
    )


class _SelfAttention(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.query = nn.Linear(shape.hidden_size, shape.hidden_size)
        self.key = nn.Linear(shape.hidden_size, shape.hidden_size)
        self.value = nn.Linear(shape.hidden_size, shape.hidden_size)


class _Output(nn.Module):
    def __init__(self, in_features: int, shape: EncoderShape) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, shape.hidden_size)
        self.LayerNorm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden).add_(residual))


class _Attention(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.self = _SelfAttention(shape)
        self.output = _Output(shape.hidden_size, shape)
        self.num_heads = shape.num_heads
        # Q, K and V as one product, set once the weights are in (`fuse_qkv`).
        self.qkv: nn.Linear | None = None

    def fuse_qkv(self) -> None:
        parts = (self.self.query, self.self.key, self.self.value)
        fused = nn.Linear(parts[0].in_features, 3 * parts[0].out_features)
        fused.to(parts[0].weight.device, parts[0].weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
        self.qkv = fused.requires_grad_(False)
        self.self = nn.Module()  # the three parts' weights are the fused one's now

    def forward(self, hidden: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        """`hidden`: flat `[num_tokens, width]`."""
        num_tokens, width = hidden.shape
        if self.qkv is not None:
            qkv = self.qkv(hidden)
        else:
            parts = (self.self.query, self.self.key, self.self.value)
            qkv = torch.cat([p(hidden) for p in parts], dim=1)
        qkv = qkv.view(num_tokens, 3, self.num_heads, -1)
        context = torch.empty_like(qkv[:, 0])
        if layout.cu_seqlens is not None:
            scale = qkv.shape[-1] ** -0.5
            native_encoder_attention(*qkv.unbind(1), layout.cu_seqlens, scale, context)
        for b in layout.buckets:
            rows = qkv[b.start : b.end]
            if b.gather is None:
                part = rows.view(b.count, b.longest, *rows.shape[1:])
            else:
                part = rows.index_select(0, b.gather).view(b.count, b.longest, *rows.shape[1:])
            q, k, v = part.permute(2, 0, 3, 1, 4)  # each [count, heads, longest, head_dim]
            mask = None if b.valid is None else b.valid[:, None, None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
            out = out.reshape(-1, *out.shape[2:])  # a view: SDPA lays heads inside tokens
            if b.slots is None:
                context[b.start : b.end] = out
            else:
                torch.index_select(out, 0, b.slots, out=context[b.start : b.end])
        return self.output(context.view(num_tokens, width), hidden)


class _Intermediate(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.dense = nn.Linear(shape.hidden_size, shape.intermediate_size)
        self.act = _ACTIVATIONS[shape.hidden_act]
        self.hidden_act = shape.hidden_act

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        method = getattr(self.dense, "quant_method", None)
        if isinstance(method, OneDNNLinearMethod) and self.hidden_act in _GELU_ALGORITHMS:
            algorithm = _GELU_ALGORITHMS[self.hidden_act]
            return method.apply_then(self.dense, hidden, "gelu", algorithm)
        return self.act(self.dense(hidden))


class _Layer(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.attention = _Attention(shape)
        self.intermediate = _Intermediate(shape)
        self.output = _Output(shape.intermediate_size, shape)

    def forward(self, hidden: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        hidden = self.attention(hidden, layout)
        return self.output(self.intermediate(hidden), hidden)


class _Encoder(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(shape) for _ in range(shape.num_layers))


class _BertPooler(nn.Module):
    """BERT's pooler (dense + tanh over the first token), the input of its classifier."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first))


class _RobertaClassifier(nn.Module):
    """RoBERTa's classification head: dense + tanh + out_proj over the first token."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class BertEncoder(nn.Module):
    """The encoder, and for `*ForSequenceClassification` its head (`classify`). Names are
    the checkpoint's without its prefix (`bert.`, `roberta.`), heads' names as stored."""

    def __init__(self, hf_config: Any, architecture: str) -> None:
        super().__init__()
        self.shape = shape = EncoderShape.from_hf_config(hf_config)
        self.prefix, self.head_kind = ENCODER_ARCHITECTURES[architecture]
        self.embeddings = _Embeddings(shape)
        self.encoder = _Encoder(shape)
        self.num_labels = int(getattr(hf_config, "num_labels", 1)) if self.head_kind else 0
        self.pooler: _BertPooler | None = None
        self.classifier: nn.Module | None = None
        if self.head_kind == "bert":
            self.pooler = _BertPooler(shape.hidden_size)
            self.classifier = nn.Linear(shape.hidden_size, self.num_labels)
        elif self.head_kind == "roberta":
            self.classifier = _RobertaClassifier(shape.hidden_size, self.num_labels)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """Flat `[num_tokens]` ids of sequences of `lengths` (each one's tokens consecutive,
        `positions` from 0 in each) -> their last hidden states, flat `[num_tokens, hidden]`."""
        hidden = self.embeddings(input_ids, token_type_ids, positions)
        layout = attention_layout(lengths.tolist(), hidden.device, hidden.dtype)
        for layer in self.encoder.layer:
            hidden = layer(hidden, layout)
        return hidden

    def fuse_qkv(self) -> None:
        """One QKV product per layer instead of three (after loading)."""
        for layer in self.encoder.layer:
            layer.attention.fuse_qkv()

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """The classification head's logits `[batch, num_labels]` from each sequence's first
        token's hidden state."""
        if self.classifier is None:
            raise ValueError("this encoder has no classification head")
        if self.pooler is not None:
            return self.classifier(self.pooler(first_tokens))
        return self.classifier(first_tokens)

    def parameter_name(self, checkpoint_name: str) -> str | None:
        """This module's name for a checkpoint tensor; None for tensors it has no use for
        (position id buffers, an MLM head)."""
        name = checkpoint_name.removeprefix(self.prefix)
        if name.startswith(("pooler.", "classifier.")) and self.head_kind is None:
            return None  # a base model's pooler: sentence-transformers does not use it
        if name.endswith("position_ids") or name.startswith(("cls.", "lm_head.")):
            return None
        return name.replace(".gamma", ".weight").replace(".beta", ".bias")
