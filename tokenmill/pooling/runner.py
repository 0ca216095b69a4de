"""One forward over a step's pooling requests, and their outputs: embeddings or scores.

An encoder keeps the step's tokens flat (no padding) through every product and attends
bidirectionally within each sequence (models/bert.py: one native call over the packed
sequences on the CPU, padded buckets of similar length elsewhere); a decoder
runs over flat tokens through its paged attention backend (the native CPU kernels and the
fused stack where they apply) with a scratch KV cache that lives only for the forward: its
blocks are reused by the next step, nothing is kept per request."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.pooling.config import PoolingConfig
from tokenmill.pooling.model_loading import PoolingModel
from tokenmill.pooling.poolers import finish_embedding, pool, score_from_logits
from tokenmill.step.layout import layout_step

SCRATCH_BLOCK_SIZE = 16


@dataclass(frozen=True)
class PoolingInput:
    """What one request asks of a forward: its tokens, BERT's segment ids for a pair, and
    what to make of the pooled state (an embedding cut to `dimensions`, or a score)."""

    token_ids: list[int]
    token_type_ids: list[int] | None = None
    task: str = "embed"  # embed or score
    dimensions: int | None = None
    normalize: bool | None = None  # None: the model's own (its Normalize module)


class PoolingRunner:
    def __init__(self, model: PoolingModel, config: PoolingConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self._scratch: list[torch.Tensor] = []
        self._scratch_blocks = 0

    @torch.inference_mode()
    def run(self, inputs: list[PoolingInput]) -> list[torch.Tensor]:
        """Each input's output: a float32 embedding `[dim]` or a 0-d score."""
        lengths = torch.tensor([len(i.token_ids) for i in inputs])
        if self.model.encoder is not None:
            hidden = self._encode(inputs, lengths)
        else:
            hidden = self._decode(inputs, lengths)
        if any(i.task == "score" for i in inputs):
            return self._scores_and_embeddings(inputs, hidden, lengths)
        return self._embeddings(inputs, pool(hidden, lengths, self.config.pooling_type))

    def _embeddings(self, inputs: list[PoolingInput], pooled: torch.Tensor) -> list[torch.Tensor]:
        outputs = []
        for row, item in zip(pooled, inputs):
            normalize = self.config.normalize if item.normalize is None else item.normalize
            outputs.append(finish_embedding(row, normalize, item.dimensions).cpu())
        return outputs

    def _scores_and_embeddings(
        self, inputs: list[PoolingInput], hidden: torch.Tensor, lengths: torch.Tensor
    ) -> list[torch.Tensor]:
        scores = self._scores(hidden, lengths)
        pooled = pool(hidden, lengths, self.config.pooling_type)
        return [
            scores[i].cpu()
            if item.task == "score"
            else self._embeddings([item], pooled[i : i + 1])[0][0]
            for i, item in enumerate(inputs)
        ]

    def _scores(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's head on each sequence's first token, or a yes/no reranker's two
        logits at its last."""
        encoder, decoder = self.model.encoder, self.model.decoder
        if encoder is not None and encoder.classifier is not None:
            first = pool(hidden, lengths, "cls").to(hidden.dtype)
            return score_from_logits(encoder.classify(first), self.config.score_activation)
        if decoder is not None and self.config.yes_no_tokens is not None:
            last = pool(hidden, lengths, "last").to(hidden.dtype)
            logits = decoder.compute_logits(last)[:, list(self.config.yes_no_tokens)]
            return torch.sigmoid(logits[:, 1] - logits[:, 0])
        raise ValueError("this model has no classification head to score with")

    def _encode(self, inputs: list[PoolingInput], lengths: torch.Tensor) -> torch.Tensor:
        encoder = self.model.encoder
        assert encoder is not None
        ids = torch.tensor([t for item in inputs for t in item.token_ids])
        types = torch.tensor(
            [t for item in inputs for t in (item.token_type_ids or [0] * len(item.token_ids))]
        )
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
        device = self.device
        return encoder(ids.to(device), types.to(device), positions.to(device), lengths.to(device))

    def _decode(self, inputs: list[PoolingInput], lengths: torch.Tensor) -> torch.Tensor:
        decoder = self.model.decoder
        assert decoder is not None
        seq_lens = lengths.numpy().astype(np.int64)
        blocks_each = -(-seq_lens // SCRATCH_BLOCK_SIZE)
        self._ensure_scratch(int(blocks_each.sum()))
        starts = np.cumsum(blocks_each) - blocks_each
        block_ids = [list(range(s, s + n)) for s, n in zip(starts, blocks_each)]
        positions, metadata = layout_step(
            block_ids,
            seq_lens,
            seq_lens,
            SCRATCH_BLOCK_SIZE,
            decoder.shape.sliding_window,
            self.device,
        )
        ids = torch.tensor([t for item in inputs for t in item.token_ids], device=self.device)
        return decoder(ids, torch.from_numpy(positions).to(self.device), self._scratch, metadata)

    def _ensure_scratch(self, num_blocks: int) -> None:
        """A KV cache of at least `num_blocks` blocks, grown (never shrunk) to the largest
        step seen; its contents are garbage between steps and never read across them."""
        if num_blocks <= self._scratch_blocks:
            return
        decoder = self.model.decoder
        assert decoder is not None
        dtype = decoder.embed_tokens.weight.dtype
        spec = KVCacheSpec(
            decoder.shape.num_layers,
            SCRATCH_BLOCK_SIZE,
            decoder.num_local_kv_heads,
            decoder.shape.head_dim,
            dtype,
        )
        self._scratch = spec.allocate(num_blocks, self.device)
        self._scratch_blocks = num_blocks
