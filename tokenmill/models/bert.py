"""Encoder-only BERT-family models (BERT, XLM-RoBERTa) for pooling: embedders and
cross-encoders.

The encoder attends bidirectionally within each sequence and keeps no KV cache: a batch is
padded to its longest sequence (`[batch, length]`), a key-padding mask hides the padding, and
the hidden states come back flat (`[num_tokens, hidden]`, padding dropped) for the poolers.
Parameter names follow the Hugging Face checkpoints, so loading is a name-for-name copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Architectures this module builds: name -> (checkpoint prefix, classification head kind).
ENCODER_ARCHITECTURES: dict[str, tuple[str, str | None]] = {
    "BertModel": ("", None),
    "XLMRobertaModel": ("", None),
    "RobertaModel": ("", None),
    "BertForSequenceClassification": ("bert.", "bert"),
    "XLMRobertaForSequenceClassification": ("roberta.", "roberta"),
    "RobertaForSequenceClassification": ("roberta.", "roberta"),
}
_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


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

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        hidden = hidden + self.position_embeddings(positions + self.position_offset)
        return self.LayerNorm(hidden)


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
        return self.LayerNorm(self.dense(hidden) + residual)


class _Attention(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.self = _SelfAttention(shape)
        self.output = _Output(shape.hidden_size, shape)
        self.num_heads = shape.num_heads

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, width = hidden.shape
        heads = [
            proj(hidden).view(batch, length, self.num_heads, -1).transpose(1, 2)
            for proj in (self.self.query, self.self.key, self.self.value)
        ]
        context = F.scaled_dot_product_attention(*heads, attn_mask=mask)
        return self.output(context.transpose(1, 2).reshape(batch, length, width), hidden)


class _Intermediate(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.dense = nn.Linear(shape.hidden_size, shape.intermediate_size)
        self.act = _ACTIVATIONS[shape.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class _Layer(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.attention = _Attention(shape)
        self.intermediate = _Intermediate(shape)
        self.output = _Output(shape.intermediate_size, shape)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        hidden = self.attention(hidden, mask)
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
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """`[batch, length]` padded ids (each row's first `lengths[i]` real) -> the real
        tokens' last hidden states, flat `[num_tokens, hidden]` in row order."""
        length = input_ids.shape[1]
        valid = torch.arange(length, device=input_ids.device)[None, :] < lengths[:, None]
        # No mask where nothing is padded: SDPA then takes its fastest kernel.
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        hidden = self.embeddings(input_ids, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, mask)
        return hidden[valid]

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
