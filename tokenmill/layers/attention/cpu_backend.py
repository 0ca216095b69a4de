"""The CPU backend: the whole step's attention in one call of the native kernel, which reads
the paged cache in place (decodes, verified drafts and prefill chunks alike); FP8 caches and
machines without the native build go through the portable `TorchPagedAttention`."""

from __future__ import annotations

import torch

from tokenmill.kernels.attention import NATIVE_ATTENTION_DTYPES, native_paged_attention
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.attention.base import AttentionMetadata, KVCache
from tokenmill.layers.attention.torch_backend import TorchPagedAttention
from tokenmill.layers.kv_cache import write_kv


class CpuPagedAttention(TorchPagedAttention):
    def forward(
        self,
        query: torch.Tensor,
        kv: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        step = metadata.step
        if (
            step is None
            or kv_cache.dtype not in NATIVE_ATTENTION_DTYPES
            or query.dtype not in NATIVE_ATTENTION_DTYPES
            or native_kernels() is None
        ):
            return super().forward(query, kv, kv_cache, metadata)
        write_kv(kv_cache, metadata.slot_mapping, kv)
        output = torch.empty(query.shape, dtype=query.dtype)
        attended = native_paged_attention(
            query,
            kv_cache,
            step.block_tables,
            step.query_start_loc,
            step.seq_lens,
            step.sliding_window if self.sliding_window is None else self.sliding_window,
            self.scale,
            output,
            self.sinks,
            self.softcap,
        )
        assert attended, "the native kernel declined a CPU float32/bfloat16 step"
        return output
