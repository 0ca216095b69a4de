"""The portable backend (`torch`): each request's context gathered from the paged cache and
attended by `scaled_dot_product_attention` on a padded batch per group. Runs anywhere; the
reference the other backends are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.base import AttentionGroup, KVCache, PagedAttention
from tokenmill.layers.kv_cache import read_kv

# Decode groups whose gathered keys and values would exceed this (half this machine's 32 MB
# L3) are attended in slices of DECODE_SLICE_ROWS (base.py); groups that fit the cache ran
# 0.86x in slices (more, smaller calls).
DECODE_SLICE_ABOVE_BYTES = 16 << 20


class TorchPagedAttention(PagedAttention):
    """The portable backend: gathers each request's context from the cache and runs
    `scaled_dot_product_attention` on a padded batch per group. Correct for any mix of chunk
    and context lengths; the reference the Triton backend is tested against."""

    def _attend_group(
        self, query: torch.Tensor, kv_cache: KVCache, group: AttentionGroup, out: torch.Tensor
    ) -> None:
        num_seqs = group.block_tables.shape[0]
        position_bytes = 2 * self.num_kv_heads * self.head_dim * query.element_size()
        gathered_bytes = num_seqs * group.kv_len * position_bytes
        if group.row_slices is None or gathered_bytes <= DECODE_SLICE_ABOVE_BYTES:
            self._attend(query, kv_cache, group.block_tables, group.kv_len, group, out)
            return
        for start, end, kv_len in group.row_slices:
            self._attend(
                query[start:end],
                kv_cache,
                group.block_tables[start:end],
                kv_len,
                group,
                out[start:end],
                rows=slice(start, end),
            )

    def _attend(
        self,
        query: torch.Tensor,
        kv_cache: KVCache,
        block_tables: torch.Tensor,
        kv_len: int,
        group: AttentionGroup,
        out: torch.Tensor,
        rows: slice | None = None,
    ) -> None:
        """Attention of `block_tables`' sequences (the group's, or the `rows` of a decode
        group) over their first `kv_len` keys."""
        num_seqs = block_tables.shape[0]
        num_blocks = -(-kv_len // kv_cache.shape[2])
        keys, values = read_kv(kv_cache, block_tables[:, :num_blocks], query.dtype)
        keys, values = keys[:, :, :kv_len], values[:, :, :kv_len]
        window = self.sliding_window
        mask = group.mask if window is None else group.windowed_mask(window)
        if mask is not None and rows is not None:
            mask = mask[rows, :, :, :kv_len]
        if group.padded_index is None:  # every sequence has max_query_len queries
            padded = query.view(num_seqs, group.max_query_len, self.num_heads, self.head_dim)
        else:
            padded = query.new_zeros(num_seqs * group.max_query_len, self.num_heads, self.head_dim)
            padded.index_copy_(0, group.padded_index, query)
            padded = padded.view(num_seqs, group.max_query_len, self.num_heads, self.head_dim)
        if self.sinks is not None:
            keys, values, mask = with_sinks(keys, values, mask, self.sinks, group.max_query_len)
        if self.softcap is not None:
            attended = softcapped_attention(
                padded.transpose(1, 2), keys, values, mask, self.scale, self.softcap
            ).transpose(1, 2)
        else:
            attended = F.scaled_dot_product_attention(
                padded.transpose(1, 2),
                keys,
                values,
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            ).transpose(1, 2)
        if group.padded_index is None:
            out.view(attended.shape).copy_(attended)
            return
        flat = attended.reshape(num_seqs * group.max_query_len, self.num_heads, self.head_dim)
        torch.index_select(flat, 0, group.padded_index, out=out)


def with_sinks(
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor,
    query_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key: a zero key and value whose score is the head's sink
    logit (an additive float mask), so it joins the softmax's denominator and adds nothing to
    the output. `keys`, `values` `[seqs, kv_heads, kv_len, d]`; `mask` bool `[seqs, 1,
    queries, kv_len]` or None."""
    num_seqs, num_kv_heads, kv_len, head_dim = keys.shape
    zero = keys.new_zeros(num_seqs, num_kv_heads, 1, head_dim)
    heads = sinks.shape[0]
    shape = (num_seqs, heads, query_len, kv_len)
    if mask is None:
        bias = keys.new_zeros(shape)
    else:
        bias = torch.zeros(mask.shape, dtype=keys.dtype).masked_fill_(~mask, float("-inf"))
        bias = bias.expand(shape)
    sink = sinks.to(keys.dtype).view(1, heads, 1, 1).expand(num_seqs, heads, query_len, 1)
    return torch.cat((keys, zero), 2), torch.cat((values, zero), 2), torch.cat((bias, sink), -1)


def softcapped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention whose scaled scores are soft-capped, cap * tanh(score / cap), before the
    softmax (Gemma 2), as transformers computes it (`scaled_dot_product_attention` has no such
    step). `query` `[seqs, heads, queries, d]`; `keys`, `values` `[seqs, kv_heads, kv_len, d]`;
    `mask` bool (True: attend) or float (added), broadcastable to the scores."""
    group = query.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values)
