"""Paged attention reading the KV cache in place (the C++ `paged_attention`).

Any mix of decodes, verified drafts and prefill chunks in one call: no gather of the context
into a padded batch, no mask tensor. The reference is `TorchPagedAttention`
(layers/attention/torch_backend.py).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.native import native_kernels

NATIVE_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
_NO_SINKS = torch.empty(0)


def native_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
    scale: float,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> bool:
    """Write the attention of `query` (`[tokens, heads, head_dim]`) to `out`; False (nothing
    written) where the native kernel does not apply. `sinks`: each head's attention-sink logit
    (`[heads]`, gpt-oss), which joins every row's softmax denominator. `softcap`: the scaled
    scores become softcap * tanh(score / softcap) before the softmax (Gemma 2)."""
    if (
        query.device.type != "cpu"
        or query.dtype not in NATIVE_ATTENTION_DTYPES
        or kv_cache.dtype not in NATIVE_ATTENTION_DTYPES
        or out.dtype not in NATIVE_ATTENTION_DTYPES
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
        _NO_SINKS if sinks is None else sinks.float().contiguous(),
        softcap or 0.0,
    )
    return True
