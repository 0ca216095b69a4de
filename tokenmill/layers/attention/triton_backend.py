"""Paged attention in one Triton kernel: K/V are read through the block tables, never gathered.

One kernel serves decodes and prefill chunks over a cached context (as vLLM's unified Triton
attention does). A program owns one sequence, one KV head and a tile of `BLOCK_Q` of that
sequence's queries; its `BLOCK_M` rows are those queries times the `G` query heads that share
the KV head (GQA), so each K/V tile is loaded once for the whole group:

    row r  ->  query  q_block * BLOCK_Q + r // G,  head  kv_head * G + r % G

It walks the keys up to its last query's position in tiles of `TILE_N`, finding each key's
cache slot through the block table (`table[key // block_size] * block_size + key %
block_size`, so any block size works), with an online softmax in float32. Causality and the
sliding window are masks on positions: no dense mask, no padding to the longest sequence.

Written for CUDA; the tests also run it on CPU tensors under `TRITON_INTERPRET=1` (set before
this module is imported: `triton.jit` reads it when decorating).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.attention.base import AttentionGroup, KVCache, PagedAttention

PREFILL_BLOCK_M = 64  # rows (queries x heads of a KV group) per program for chunks
TILE_N = 32  # keys per inner iteration


@triton.jit
def _dot(a, b, FP32_DOT: tl.constexpr):
    if FP32_DOT:  # noqa: SIM108 (a constexpr branch the Triton compiler resolves)
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _online_softmax_step(q, k, v, allowed, scale, m_i, l_i, acc, FP32_DOT: tl.constexpr):
    """Fold one tile of keys (`k`: [dim, keys], `v`: [keys, dim]) into the running max `m_i`,
    denominator `l_i` and unnormalised output `acc` of each row."""
    scores = tl.where(allowed, _dot(q, k, FP32_DOT) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOT)
    return m_new, l_i, acc


@triton.jit
def _attend_context(
    q,
    q_pos,
    kv_ptr,  # at this program's KV head
    table,  # this sequence's block table row
    kv_start,
    kv_end,
    kv_stride_kv,
    kv_stride_block,
    kv_stride_slot,
    dims,
    dim_valid,
    scale,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """Rows `q` attend to keys [kv_start, kv_end), each row up to its position `q_pos`."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    for tile_start in range(kv_start, kv_end, TILE_N):
        keys = tile_start + tl.arange(0, TILE_N)
        key_valid = keys < kv_end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = block * kv_stride_block + (keys % BLOCK_SIZE) * kv_stride_slot
        k = tl.load(
            kv_ptr + slot[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        v = tl.load(
            kv_ptr + kv_stride_kv + slot[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        allowed = key_valid[None, :] & (keys[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (keys[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        m_i, l_i, acc = _online_softmax_step(
            q, k.to(q.dtype), v.to(q.dtype), allowed, scale, m_i, l_i, acc, FP32_DOT
        )
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    q_stride_token,
    q_stride_head,
    out_stride_token,
    out_stride_head,
    kv_stride_kv,
    kv_stride_block,
    kv_stride_slot,
    kv_stride_head,
    table_stride_seq,
    BLOCK_SIZE: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    FP32_DOT: tl.constexpr,  # products in float32 (IEEE, not TF32) instead of q's dtype
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= query_len:
        return
    context_len = tl.load(seq_lens_ptr + seq) - query_len

    rows = tl.arange(0, BLOCK_M)
    q_index = q_block * BLOCK_Q + rows // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_index < query_len)
    q_pos = context_len + q_index
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    token = (q_start + q_index).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * q_stride_token + head[:, None] * q_stride_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    last_q = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, query_len) - 1
    kv_start = 0
    if SLIDING_WINDOW > 0:
        first_pos = context_len + q_block * BLOCK_Q
        kv_start = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0) // TILE_N * TILE_N
    out = _attend_context(
        q,
        q_pos,
        kv_ptr + kv_head * kv_stride_head,
        block_tables_ptr + seq.to(tl.int64) * table_stride_seq,
        kv_start,
        context_len + last_q + 1,
        kv_stride_kv,
        kv_stride_block,
        kv_stride_slot,
        dims,
        dim_valid,
        scale,
        BLOCK_M,
        HEAD_DIM_PADDED,
        BLOCK_SIZE,
        TILE_N,
        SLIDING_WINDOW,
        FP32_DOT,
    )
    tl.store(
        out_ptr
        + token[:, None] * out_stride_token
        + head[:, None] * out_stride_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


class TritonPagedAttention(PagedAttention):
    """Attention over the paged cache in one kernel launch per attention group."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.queries_per_kv = num_heads // num_kv_heads
        self.head_dim_padded = max(16, triton.next_power_of_2(head_dim))

    def _attend_group(
        self, query: torch.Tensor, kv_cache: KVCache, group: AttentionGroup, out: torch.Tensor
    ) -> None:
        assert group.query_start_loc is not None and group.seq_lens is not None
        assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1
        g = self.queries_per_kv
        if group.max_query_len == 1:
            block_q, block_m = 1, max(16, triton.next_power_of_2(g))
        else:
            block_q = max(1, PREFILL_BLOCK_M // g)
            block_m = max(16, triton.next_power_of_2(block_q * g))
        num_seqs = group.seq_lens.shape[0]
        grid = (num_seqs, triton.cdiv(group.max_query_len, block_q), self.num_kv_heads)
        _paged_attention_kernel[grid](
            query,
            kv_cache,
            out,
            group.block_tables,
            group.seq_lens,
            group.query_start_loc,
            self.scale,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            group.block_tables.stride(0),
            BLOCK_SIZE=kv_cache.shape[2],
            NUM_QUERIES_PER_KV=g,
            HEAD_DIM=self.head_dim,
            HEAD_DIM_PADDED=self.head_dim_padded,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            TILE_N=TILE_N,
            SLIDING_WINDOW=self.sliding_window or group.sliding_window or 0,
            FP32_DOT=query.dtype == torch.float32
            or (_interpreting() and query.dtype.itemsize == 2),
        )


def _interpreting() -> bool:
    """Triton 3.9's interpreter gets tl.dot of bfloat16 operands wrong (values ~1e10): under it,
    16-bit products are taken in float32."""
    return bool(triton.knobs.runtime.interpret)
