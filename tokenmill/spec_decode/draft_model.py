"""Drafts from a smaller model that shares the target's tokenizer.

The draft model keeps its own KV cache in the target's block layout: same block ids, same slot
mapping, its own tensors. It runs on every target step's inputs (so its cache covers exactly
the positions the target computed, rejected drafts included, which later steps overwrite), then
proposes k tokens greedily, one batched decode step per token. Its proposals are deterministic,
which is what the verifier assumes (see rejection_sampler.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.layers.attention import AttentionMetadata, build_attention_group
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.worker.kv_cache import KVCacheSpec

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import CachedRequestState, StepInputs


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache_spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = kv_cache_spec.block_size
        self.device = device
        self.kv_caches = kv_cache_spec.allocate(num_blocks, device)
        self.max_position = model.shape.max_position

    @torch.inference_mode()
    def observe_step(self, inputs: StepInputs) -> None:
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        """k greedy steps for every request, each fed its last verified token first. A request
        stops early where its block table has no slot left (it is near `max_model_len`)."""
        proposals: dict[str, list[int]] = {s.req_id: [] for s in states}
        active = list(states)
        tokens = [s.token_ids[-1] for s in active]
        for step in range(num_tokens):
            positions = [len(s.token_ids) - 1 + step for s in active]
            keep = [
                i
                for i, (s, p) in enumerate(zip(active, positions))
                if p < len(s.block_ids) * self.block_size and p < self.max_position
            ]
            if not keep:
                break
            active = [active[i] for i in keep]
            tokens = [tokens[i] for i in keep]
            positions = [positions[i] for i in keep]
            next_tokens = self._decode_step(active, tokens, positions)
            for state, token in zip(active, next_tokens):
                proposals[state.req_id].append(token)
            tokens = next_tokens
        return {req_id: drafts for req_id, drafts in proposals.items() if drafts}

    def _decode_step(
        self, states: list[CachedRequestState], tokens: list[int], positions: list[int]
    ) -> list[int]:
        positions_np = np.array(positions, dtype=np.int64)
        seq_lens = positions_np + 1
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        block_tables = np.zeros((len(states), max_blocks), dtype=np.int64)
        for row, (state, n) in enumerate(zip(states, -(-seq_lens // self.block_size))):
            block_tables[row, :n] = state.block_ids[:n]
        slots = (
            block_tables[np.arange(len(states)), positions_np // self.block_size] * self.block_size
            + positions_np % self.block_size
        )
        group = build_attention_group(
            token_start=0,
            query_lens=torch.ones(len(states), dtype=torch.long),
            seq_lens=torch.from_numpy(seq_lens),
            block_tables=torch.from_numpy(block_tables),
            block_size=self.block_size,
            sliding_window=None,
        )
        for name in ("block_tables", "mask"):
            setattr(group, name, getattr(group, name).to(self.device))
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(self.device), groups=[group]
        )
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        hidden = self.model(
            input_ids, torch.from_numpy(positions_np).to(self.device), self.kv_caches, metadata
        )
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()
