"""EAGLE drafts: one decoder layer on the target's own hidden states.

At position p the layer reads fc([embed(t[p+1]), h[p]]), where h[p] is the target's last
(post-norm) hidden state at p, and predicts h[p+1]; the target's LM head turns that into a
token. Drafting k tokens after the last verified token t[n-1]: the layer runs over the
positions it has not seen (up to n - 2, whose features the target computed in its steps),
whose last output gives draft 1; then k - 1 single-token steps, each feeding back the token
it drafted and the feature it predicted. Its one layer of KV lives in the target's block
layout (same block ids and slots, its own tensors), as the draft model's does.

Features come from the runner (`record_hidden_states`): the rows of every scheduled token
the target verified, kept on the request until the next proposal consumes them, so steps
without drafts cost one slice per request. A proposal catches up within a per-step budget
(catch_up.py), so drafting again after a stretch without drafts costs about what a steady
step does; a request further behind drafts a few steps later. While nothing drafts, a
request keeps only its last FEATURE_WINDOW positions' features (what two steps' catch-up
budget can use). Positions whose features were dropped, or that the target never computed
in this runner (a prefix-cache hit, a request swapped back in), keep whatever EAGLE KV their
blocks hold: drafts may be worse there, outputs are the same (verification is lossless).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from tokenmill.kernels.argmax import argmax_rows
from tokenmill.layers.kv_cache import KVCacheSpec, read_kv, write_kv
from tokenmill.layers.parallel import SINGLE
from tokenmill.layers.rotary import apply_rotary_
from tokenmill.models.llama import (
    ArchitectureTraits,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    ModelShape,
)
from tokenmill.quantization.int8 import MAX_INT8_ROWS
from tokenmill.spec_decode.catch_up import catch_up_allowances
from tokenmill.spec_decode.proposer import proposal_threads
from tokenmill.step.layout import block_table_array

if TYPE_CHECKING:
    from tokenmill.step.runner_request_state import CachedRequestState

# Catch-up tokens per step beyond the steady state's (see catch_up.py).
CATCH_UP_EXTRA_TOKENS = 256
# Positions of features a request keeps while it does not draft; older ones are dropped.
FEATURE_WINDOW = 2 * CATCH_UP_EXTRA_TOKENS
# Chunks (one a step) a request may hold before they are copied into one tensor of the last
# FEATURE_WINDOW rows: each chunk is a view that keeps its whole step's output alive.
MAX_FEATURE_CHUNKS = 32


class OneLayerDraft(nn.Module):
    """What a one-layer draft over the target's features shares (EAGLE's, MTP's): the target's
    embedding, rotary table and LM head borrowed, not copied, or an int8 copy of the head."""

    def __init__(self, shape: ModelShape, target: LlamaForCausalLM) -> None:
        super().__init__()
        self.shape = shape
        self.num_local_kv_heads = shape.num_kv_heads  # the layer is never sharded
        self._target = (target,)  # a tuple: not a submodule (not saved, not converted twice)
        # The LM head drafts use; None: the target's (an int8 copy: see head_checkpoint.py).
        self.draft_lm_head: nn.Module | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of already normed rows."""
        if self.draft_lm_head is not None and hidden.shape[0] <= MAX_INT8_ROWS:
            return self.draft_lm_head(hidden)
        return self._target[0].compute_logits(hidden)


class EagleDraft(OneLayerDraft):
    """fc + one Llama decoder layer without its input norm; the target's embedding, rotary
    table and LM head are borrowed, not copied. With `current_token` (a tokenmill extension of
    the format, told by fc's width: 3 x hidden) fc also reads the embedding of token p at p,
    which lets one layer find where in the prompt the token it continues stands."""

    def __init__(
        self, shape: ModelShape, target: LlamaForCausalLM, fc_bias: bool, current_token: bool
    ) -> None:
        super().__init__(shape, target)
        self.current_token = current_token
        width = (3 if current_token else 2) * shape.hidden_size
        self.fc = nn.Linear(width, shape.hidden_size, bias=fc_bias)
        layer = LlamaDecoderLayer(shape, ArchitectureTraits(), SINGLE)
        layer.input_layernorm = nn.Identity()  # EAGLE: the features are already normalised
        self.layers = nn.ModuleList([layer])

    def layer_input(
        self,
        next_ids: torch.Tensor,
        features: torch.Tensor,
        current_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fc's output at positions p: next_ids = token p + 1, features = h[p] (the
        target's or predicted), current_ids = token p."""
        embed = self._target[0].embed_tokens
        parts = [embed(next_ids), features]
        if self.current_token:
            parts.append(embed(current_ids))
        return self.fc(torch.cat(parts, dim=-1))

    def attention_input(self, x: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """What the layer's QKV projection reads: EAGLE's layer has no input norm."""
        return x

    def greedy(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the drafted token ids, the feature the next step reads) from the layer's output."""
        return argmax_rows(self.compute_logits(out)), out


class EagleProposer:
    """Drafts with one layer on the target's features: an EAGLE layer or a checkpoint's MTP
    layer (`mtp.py`), which differ only in the layer's input, its attention's input and how
    its output becomes a token and the next step's feature."""

    def __init__(
        self,
        draft: OneLayerDraft,
        kv_cache_spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
    ) -> None:
        self.draft = draft
        self.block_size = kv_cache_spec.block_size
        self.device = device
        self.kv_caches = kv_cache_spec.allocate(num_blocks, device)
        # Positions the draft knows and the target's RoPE tables (which it uses) cover.
        self.max_position = min(draft.shape.max_position, draft._target[0].rotary.max_position)
        shape = draft._target[0].shape
        own = sum(p.numel() for p in draft.parameters())
        self.proposal_threads = proposal_threads(own + shape.vocab_size * shape.hidden_size)

    def record_hidden_states(
        self, state: CachedRequestState, first_position: int, hidden: torch.Tensor
    ) -> None:
        """The target's features at positions first_position, first_position + 1, ..."""
        if not hidden.shape[0]:
            return
        chunks = state.draft_hidden
        chunks.append((first_position, hidden))
        end = first_position + hidden.shape[0]
        if len(chunks) > MAX_FEATURE_CHUNKS or end - chunks[0][0] > 2 * FEATURE_WINDOW:
            first = max(end - FEATURE_WINDOW, chunks[0][0])
            state.draft_hidden = [(first, _rows(chunks, first, end).clone())]

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        behind = [(s, first) for s in states if (first := self._first_pending(s)) is not None]
        gaps = [len(s.token_ids) - 1 - first for s, first in behind]
        allowances = catch_up_allowances(gaps, num_tokens, CATCH_UP_EXTRA_TOKENS)
        pieces = [self._take(s, first, a) for (s, first), a in zip(behind, allowances) if a]
        if not pieces:
            return {}
        # Requests brought part of the way draft once caught up.
        active, x, q = self._catch_up(pieces)
        if not active:
            return {}
        ends = [len(s.token_ids) - 1 for s in active]  # positions 0 .. end - 1 are in the cache
        steps = [
            min(num_tokens - 1, sum(1 for j in range(num_tokens - 1) if self._has_slot(s, e + j)))
            for s, e in zip(active, ends)
        ]
        drafted = self._draft_chain(active, ends, x, q, max(steps))
        return {s.req_id: row[: n + 1] for s, row, n in zip(active, drafted.tolist(), steps)}

    def _catch_up(self, pieces: list[tuple]) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Write the layer's keys and values at every piece's positions into its paged cache.
        Only keys and values are needed there (fc and the QKV projection, no attention or
        MLP): of the layer's outputs, drafting reads only each request's last one, which
        `_draft_chain` computes. Returns the requests whose pieces reach their last token,
        with the layer's input and rotated query at that last position, `[requests, ...]`."""
        draft, attn = self.draft, self.draft.layers[0].self_attn
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        ids: list[int] = []
        current: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for state, first, features in pieces:
            end = first + features.shape[0]
            ids.extend(state.token_ids[first + 1 : end + 1])
            current.extend(state.token_ids[first:end])
            positions.extend(range(first, end))
            blocks = state.block_ids
            slots.extend(blocks[p // self.block_size] * self.block_size + p % self.block_size
                         for p in range(first, end))  # fmt: skip
        features = torch.cat([p[2] for p in pieces]) if len(pieces) > 1 else pieces[0][2]
        next_ids = torch.tensor(ids, device=self.device)
        at = torch.tensor(positions, device=self.device)
        x = draft.layer_input(next_ids, features, torch.tensor(current, device=self.device), at)
        qkv = self._qkv(x, next_ids, at)
        rows = x.shape[0]
        kv = qkv[:, heads * dim :].view(rows, 2, kv_heads, dim)
        write_kv(self.kv_caches[0], torch.tensor(slots, device=self.device), kv)
        lasts = np.cumsum([p[2].shape[0] for p in pieces]) - 1
        done = [i for i, (s, _, _) in enumerate(pieces) if _caught_up(s)]
        if not done:
            return [], x[:0], qkv[:0]
        index = torch.from_numpy(lasts[done]).to(self.device)
        return [pieces[i][0] for i in done], x[index], qkv[index, : heads * dim]

    def _draft_chain(
        self,
        states: list[CachedRequestState],
        ends: list[int],
        x: torch.Tensor,
        q: torch.Tensor,
        num_steps: int,
    ) -> torch.Tensor:
        """`[requests, 1 + num_steps]` greedy drafts: the first from the layer's input `x` and
        query `q` at each request's last cached position (end - 1), then `num_steps` more,
        each step feeding back the token and feature it predicted at the next position.

        The steps' keys never reach the paged cache (the next catch-up overwrites those
        positions with the target's features anyway): the context's keys are gathered once,
        into a buffer with room for the steps' own, so a step is the layer's few matmuls and
        one attention over that buffer, with no metadata, cache write or gather of its own."""
        draft, layer = self.draft, self.draft.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        rows = len(states)
        context = torch.tensor(ends, device=self.device)  # positions 0 .. end - 1 are known
        table = self._block_table(states, ends)
        # Attention in float32: torch's bfloat16 attention of one query costs ~1 ms on a CPU.
        keys, values = read_kv(self.kv_caches[0], table, torch.float32)
        width = max(ends)
        kv = x.new_zeros(2, rows, kv_heads, width + num_steps, dim, dtype=torch.float32)
        kv[0, :, :, :width] = keys[:, :, :width]
        kv[1, :, :, :width] = values[:, :, :width]
        mask = None  # every step sees the steps before it, and its context
        if min(ends) < width:
            columns = torch.arange(width + num_steps, device=self.device)
            visible = (columns[None, :] < context[:, None]) | (columns[None, :] >= width)
            mask = visible[:, None, None, :]

        def layer_output(x: torch.Tensor, q: torch.Tensor, end: int) -> torch.Tensor:
            # One query a request, as two small matmuls: torch's CPU attention kernel wakes
            # its OpenMP threads for a few microseconds of work (~0.7 ms a call in a step).
            grouped = q.float().view(rows, kv_heads, heads // kv_heads, dim)
            scores = torch.matmul(grouped, kv[0, :, :, :end].transpose(-1, -2)) * attn.attn.scale
            if mask is not None:
                scores.masked_fill_(~mask[..., :end], float("-inf"))
            out = torch.matmul(scores.softmax(dim=-1), kv[1, :, :, :end])
            x = x + attn.o_proj(out.reshape(rows, heads * dim).to(x.dtype))
            return x + mlp(layer.post_attention_layernorm(x))

        tokens, features = draft.greedy(layer_output(x, q, width))
        drafted = [tokens]
        previous = torch.tensor([s.token_ids[-1] for s in states], device=self.device)
        for step in range(num_steps):
            x = draft.layer_input(tokens, features, previous)
            qkv = self._qkv(x, tokens, context + step)
            previous = tokens
            column = width + step
            kv[:, :, :, column] = qkv[:, heads * dim :].view(rows, 2, kv_heads, dim).transpose(0, 1)
            tokens, features = draft.greedy(layer_output(x, qkv[:, : heads * dim], column + 1))
            drafted.append(tokens)
        return torch.stack(drafted, dim=1)

    def _qkv(self, x: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor):
        """The layer's queries, keys and values at `positions` (RoPE applied; q/k norms
        first where the layer has them, as a Qwen3 target's MTP layer does)."""
        attn = self.draft.layers[0].self_attn
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = attn.qkv_proj(self.draft.attention_input(x, next_ids))
        rows = qkv.shape[0]
        qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
        if attn.q_norm is not None and attn.k_norm is not None:
            qk[:, :heads].copy_(attn.q_norm(qk[:, :heads]))
            qk[:, heads:].copy_(attn.k_norm(qk[:, heads:]))
        apply_rotary_(qk, *self.draft._target[0].rotary.cos_sin(positions))
        return qkv

    def _block_table(self, states: list[CachedRequestState], ends: list[int]) -> torch.Tensor:
        """`[requests, blocks]`: each request's blocks up to position `end` (or its last)."""
        lens = np.minimum(np.array(ends), [len(s.block_ids) * self.block_size for s in states])
        table = block_table_array([s.block_ids for s in states], lens, self.block_size)
        return torch.from_numpy(table).to(self.device)

    def _has_slot(self, state: CachedRequestState, position: int) -> bool:
        return position < len(state.block_ids) * self.block_size and position < self.max_position

    def _first_pending(self, state: CachedRequestState) -> int | None:
        """The first position the layer has not run over, if the request's features reach
        its position n - 2 (the token before its last) and it has room to draft; else None
        (and its features are dropped)."""
        chunks = state.draft_hidden
        last = len(state.token_ids) - 2
        if not chunks or chunks[-1][0] + chunks[-1][1].shape[0] - 1 != last:
            state.draft_hidden = []
            return None
        first = max(state.num_draft_computed_tokens, chunks[0][0])
        if first > last or not self._has_slot(state, last):
            state.draft_hidden = []
            return None
        return first

    def _take(self, state: CachedRequestState, first: int, count: int) -> tuple:
        """(state, first, features) for positions first .. first + count - 1; the rest of the
        request's features stay for a later step."""
        end = first + count
        features = _rows(state.draft_hidden, first, end)
        state.draft_hidden = [
            (max(start, end), rows[max(0, end - start) :])
            for start, rows in state.draft_hidden
            if start + rows.shape[0] > end
        ]
        state.num_draft_computed_tokens = end
        return state, first, features


def _caught_up(state: CachedRequestState) -> bool:
    return state.num_draft_computed_tokens == len(state.token_ids) - 1


def _rows(chunks: list[tuple[int, torch.Tensor]], first: int, end: int) -> torch.Tensor:
    """The features of positions first .. end - 1 out of consecutive (start, rows) chunks (a
    position sent twice is taken once)."""
    rows = []
    for start, r in chunks:
        low, high = max(first, start), min(end, start + r.shape[0])
        if high > low:
            rows.append(r[low - start : high - start])
            first = high
    return rows[0] if len(rows) == 1 else torch.cat(rows)
