"""The CPU backend: short-query groups of few sequences (decodes, drafts verified, short
chunks) through the native kernel that reads the paged cache in place; prefill chunks, larger
groups, other dtypes (FP8 caches) and machines without the native build through the portable
`TorchPagedAttention`."""

from __future__ import annotations

import torch

from tokenmill.kernels.attention import (
    NATIVE_ATTENTION_MAX_QUERY_LEN,
    NATIVE_ATTENTION_MAX_SEQS,
    native_paged_attention,
)
from tokenmill.layers.attention import AttentionGroup, KVCache, TorchPagedAttention


class CpuPagedAttention(TorchPagedAttention):
    def _attend_group(
        self, query: torch.Tensor, kv_cache: KVCache, group: AttentionGroup, out: torch.Tensor
    ) -> None:
        if (
            group.max_query_len <= NATIVE_ATTENTION_MAX_QUERY_LEN
            and group.block_tables.shape[0] <= NATIVE_ATTENTION_MAX_SEQS
            and group.query_start_loc is not None
            and group.seq_lens is not None
            and native_paged_attention(
                query,
                kv_cache,
                group.block_tables,
                group.query_start_loc,
                group.seq_lens,
                group.sliding_window,
                self.scale,
                out,
            )
        ):
            return
        super()._attend_group(query, kv_cache, group, out)
