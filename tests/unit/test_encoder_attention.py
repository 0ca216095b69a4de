"""The native varlen encoder attention against torch's SDPA run on each sequence alone, at
every ISA level this CPU has (portable, AVX2, AVX-512: the `isa` fixture)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import native
from tokenmill.kernels.encoder_attention import cu_seqlens_of, native_encoder_attention

module = native.native_kernels()
needs_native = pytest.mark.skipif(module is None, reason="native kernels not buildable here")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int], scale: float
) -> torch.Tensor:
    """SDPA in float32 on each sequence alone (no mask: every token sees its sequence)."""
    group = query.shape[1] // key.shape[1]
    parts, start = [], 0
    for n in lengths:
        q, k, v = (t[start : start + n].float().transpose(0, 1) for t in (query, key, value))
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        parts.append(F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(parts)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "head_dim"),
    [
        ([16, 1, 37, 130, 7, 64], 12, 12, 32),  # bge-small's heads; one 1-token sequence
        ([3, 200], 4, 2, 64),  # grouped keys; a sequence over the 64-query block
        ([9, 23], 2, 2, 24),  # head_dim 24: AVX-512 falls back to AVX2 (16 does not divide)
        ([5, 11], 3, 3, 12),  # head_dim 12: the portable body at every level
        ([300], 1, 1, 128),  # one sequence: split in query blocks for the threads
    ],
)
def test_matches_sdpa_per_sequence(
    isa: int, dtype: torch.dtype, lengths: list[int], heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(sum(lengths) + heads)
    tokens = sum(lengths)
    width = (heads + 2 * kv_heads) * head_dim
    # Q, K and V as strided views of one fused product's rows, as the encoder passes them.
    fused = torch.randn(tokens, width, dtype=dtype) * 2
    query = fused[:, : heads * head_dim].view(tokens, heads, head_dim)
    key = fused[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, -1)
    value = fused[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype)
    native_encoder_attention(query, key, value, cu_seqlens_of(lengths), scale, out)
    expected = reference(query, key, value, lengths, scale)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_native
def test_rejects_offsets_that_do_not_cover_the_rows() -> None:
    query = torch.randn(10, 2, 8)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        native_encoder_attention(
            query, query, query, cu_seqlens_of([4, 5]), 1.0, torch.empty_like(query)
        )
