"""An encoder's bidirectional attention over a step's packed sequences (the C++
`encoder_attention`): every sequence and head in one call, no padding, no mask.

Sequences of a step lie one after another in the flat token rows (`cu_seqlens`: sequence `s`
is rows `cu_seqlens[s]:cu_seqlens[s + 1]`); each attends to itself only. The reference is
torch's `scaled_dot_product_attention` per sequence (tests/unit/test_encoder_attention.py).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.native import native_kernels

ENCODER_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)


def encoder_attention_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `native_encoder_attention` runs for tensors of this device and dtype."""
    return (
        device.type == "cpu" and dtype in ENCODER_ATTENTION_DTYPES and native_kernels() is not None
    )


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    """`[seqs + 1]` int32 offsets of each sequence's first row (and the end)."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0, out=offsets[1:])
    return offsets


def native_encoder_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Write the attention of `query` (`[tokens, heads, head_dim]`, rows may be strided, as
    views of a fused QKV product's output are) over `key` and `value` (`[tokens, kv_heads,
    head_dim]`) within each sequence to `out`. Callers check `encoder_attention_applies`."""
    module = native_kernels()
    assert module is not None, "native kernels unavailable: check encoder_attention_applies"
    module.encoder_attention(query, key, value, cu_seqlens, scale, out)
