"""Paged attention of short queries reading the KV cache in place (the C++ `paged_attention`).

For decodes, speculative verification and short chunks: no gather of the context into a
padded batch, no mask tensor. The reference is `TorchPagedAttention` (layers/attention.py).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.native import native_kernels

# Queries per sequence up to which a group runs natively; longer chunks (prefill) go to
# scaled_dot_product_attention, whose blocked kernel is faster there.
NATIVE_ATTENTION_MAX_QUERY_LEN = 16
# Sequences per group up to which it runs natively: per layer (SmolLM2-135M's heads, contexts
# 130-260, fp32, thread CPU) it took 0.034 ms at 1 sequence against the portable 0.047-0.051,
# but ~1.1 against 0.98-1.36 at 16, and decode steps of 16 rows cost 55-60 vs 65-70 ms CPU with
# it (its dot products do not yet reach SDPA's blocked kernel). Between 1 and 16 unmeasured.
NATIVE_ATTENTION_MAX_SEQS = 4


def native_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Write the attention of `query` (`[tokens, heads, head_dim]`) to `out`; False (nothing
    written) where the native kernel does not apply."""
    if (
        query.device.type != "cpu"
        or query.dtype not in (torch.float32, torch.bfloat16)
        or kv_cache.dtype != query.dtype
        or not out.is_contiguous()
        or query.stride(-1) != 1
        or query.stride(1) != query.shape[2]
    ):
        return False
    module = native_kernels()
    if module is None:
        return False
    module.paged_attention(
        query,
        kv_cache,
        block_tables.contiguous(),
        query_start_loc,
        seq_lens,
        sliding_window or 0,
        scale,
        out,
    )
    return True
