"""The CPU backend: the portable one, with decodes attended per KV head and masks made once.

Two changes to `TorchPagedAttention`'s decode path, each measured (docs/benchmarks.md,
"Attention backends on the CPU"):

- GQA folded into the query length: the `G` query heads that share a KV head attend as `G`
  queries of that head (`[seqs, kv_heads, G, head_dim]`), so `scaled_dot_product_attention`
  walks each sequence's keys once per KV head instead of once per query head.
- The mask as 0 / -inf addends, made by the first layer and reused by the rest
  (`AttentionGroup.additive_mask`); SDPA converts a boolean one on every call.

Chunks (query length > 1) take the portable path with the same reused mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention import AttentionGroup, KVCache, TorchPagedAttention
from tokenmill.layers.kv_cache import read_kv


class CpuPagedAttention(TorchPagedAttention):
    def _attend_group(
        self, query: torch.Tensor, kv_cache: KVCache, group: AttentionGroup
    ) -> torch.Tensor:
        if group.max_query_len > 1:
            return super()._attend_group(query, kv_cache, group)
        num_seqs = group.block_tables.shape[0]
        keys, values = read_kv(kv_cache, group.block_tables, query.dtype)
        keys, values = keys[:, :, : group.kv_len], values[:, :, : group.kv_len]
        # Query head h uses KV head h // G: heads of one KV head are adjacent.
        queries_per_kv = self.num_heads // self.num_kv_heads
        folded = query.view(num_seqs, self.num_kv_heads, queries_per_kv, self.head_dim)
        out = F.scaled_dot_product_attention(
            folded, keys, values, attn_mask=group.additive_mask(query.dtype), scale=self.scale
        )
        return out.reshape(num_seqs, self.num_heads, self.head_dim)

    def _mask(self, group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor | None:
        return group.additive_mask(dtype)
