"""Drafts from a smaller model that shares the target's tokenizer.

The draft model keeps its own KV cache in the target's block layout: same block ids, same slot
mapping, its own tensors. It computes that cache lazily: only when asked to propose does it
run over the tokens it has not seen yet (a whole prompt the first time, afterwards the tokens
verified since its last proposal; within a budget per step, so a request far behind drafts
a step or a few later), then it proposes k tokens greedily, one batched decode step per
token. Steps where the policy drafts nothing therefore cost the draft model nothing, so
speculation switched down to k = 0 under load costs what no speculation costs. Proposals are
deterministic, which is what the verifier assumes (see verification.py).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from tokenmill.kernels.argmax import argmax_rows
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.layers.linear import Linear
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.spec_decode.catch_up import catch_up_allowances
from tokenmill.spec_decode.proposer import SMALL_DRAFT_ELEMENTS, torch_threads
from tokenmill.step.layout import attention_group_key, layout_decode, layout_step

if TYPE_CHECKING:
    from tokenmill.step.runner_request_state import CachedRequestState

# Tokens per catch-up forward: a batch of new prompts is split like a prefill under a budget.
CATCH_UP_TOKENS_PER_FORWARD = 2048
# Catch-up tokens per step beyond the steady state's: bounds what drafting again after steps
# without drafts (the policy exploring) costs, when every running request is behind.
CATCH_UP_EXTRA_TOKENS = 256

# Rows a small draft's forward runs on one thread up to (`DraftModelProposer.one_thread_rows`).
ONE_THREAD_ROWS = 4

# (request, first position, end position) of one request's tokens in a catch-up forward.
Piece = tuple["CachedRequestState", int, int]


class DraftModelProposer:
    proposal_threads: int | None = None  # the engine's threads

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache_spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.block_size = kv_cache_spec.block_size
        self.device = device
        self.kv_caches = kv_cache_spec.allocate(num_blocks, device)
        self.max_position = model.rotary.max_position  # the positions its RoPE tables cover
        self.sliding_window = model.shape.sliding_window
        # The native chain (`_native_chain`): None until first asked, False where it cannot run
        # or TOKENMILL_NATIVE_DRAFT_CHAIN=0 (A/B measurements) when the proposer is made.
        self._native: tuple[Any, torch.Tensor, Any] | Literal[False] | None = (
            False if os.environ.get("TOKENMILL_NATIVE_DRAFT_CHAIN") == "0" else None
        )
        # A small draft's forward of at most this many rows runs on one thread: at batch 1 a
        # chain step is a row through ~20 phases of microseconds each, and handing each phase
        # to the pool's other thread costs more than it saves. 0: the engine's threads always
        # (A/B measurements).
        # The catch-up folded into the native chain's call (`_whole_proposal`); False: two
        # calls (A/B measurements).
        self.fold_catch_up = True
        shape = model.shape  # its weights by shape: packed linears are not parameters
        attention = shape.head_dim * (2 * shape.num_heads + 2 * shape.num_kv_heads)
        layer = shape.hidden_size * (attention + 3 * shape.intermediate_size)
        elements = shape.num_layers * layer + shape.vocab_size * shape.hidden_size
        small = elements <= SMALL_DRAFT_ELEMENTS
        self.one_thread_rows = ONE_THREAD_ROWS if small else 0

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        """k greedy tokens for every request that has room for them and whose catch-up fits
        this step's budget. A request stops early where its block table has no slot left
        (it is near `max_model_len`)."""
        active = [s for s in states if self._has_slot(s, len(s.token_ids) - 1)]
        if not active:
            return {}
        for state in active:
            credit_fed_tokens(state)
        # New prompts, and requests back from steps without drafts, catch up within a
        # budget (catch_up.py) and draft once caught up.
        gaps = [len(s.token_ids) - s.num_draft_computed_tokens for s in active]
        allowances = catch_up_allowances(gaps, num_tokens, CATCH_UP_EXTRA_TOKENS)
        if allowances == gaps and 0 < sum(gaps) <= CATCH_UP_TOKENS_PER_FORWARD and min(gaps) > 0:
            whole = self._whole_proposal(active, num_tokens)
            if whole is not None:
                return whole
        ends = [(s, s.num_draft_computed_tokens + a) for s, a in zip(active, allowances)]
        first_tokens = self._catch_up(ends)
        active = [s for s in active if s.req_id in first_tokens]
        tokens = [first_tokens[s.req_id] for s in active]
        proposals: dict[str, list[int]] = {s.req_id: [t] for s, t in zip(active, tokens)}
        if self._chain(active, tokens, num_tokens, proposals):
            return proposals
        for step in range(1, num_tokens):
            positions = [len(s.token_ids) - 1 + step for s in active]
            keep = [i for i, (s, p) in enumerate(zip(active, positions)) if self._has_slot(s, p)]
            if not keep:
                break
            active = [active[i] for i in keep]
            positions = [positions[i] for i in keep]
            tokens = self._decode_step(active, [tokens[i] for i in keep], positions)
            for state, token in zip(active, tokens):
                proposals[state.req_id].append(token)
        return proposals

    def _chain(
        self,
        states: list[CachedRequestState],
        tokens: list[int],
        num_tokens: int,
        proposals: dict[str, list[int]],
    ) -> bool:
        """The k - 1 chain steps on the fused stack with one step layout for the whole chain,
        updated in place (positions, slots, lengths: Python ints into numpy views of the
        tensors), as a chain step's own work is ~0.05 ms and everything around it was most of
        the rest. False (nothing done) where the stack does not run the draft or a request
        runs out of slots within the chain: the step-by-step loop handles those."""
        if not states or num_tokens < 2 or self.model.decoder_stack is None:
            return False
        last = [len(s.token_ids) - 1 + num_tokens - 1 for s in states]
        if not all(self._has_slot(s, p) for s, p in zip(states, last)):
            return False
        layout, metadata = layout_decode(
            [s.block_ids for s in states],
            [p + 1 for p in last],
            self.block_size,
            self.sliding_window,
            self.device,
        )
        if not self.model.decoder_stack.applies(metadata, self.kv_caches):
            return False
        step = metadata.step
        assert step is not None
        native = self._native_chain()
        if native is not None:  # the whole chain in one call
            module, embedding, head = native
            for i, state in enumerate(states):  # chain step 0's; the rest is native
                layout[i] = len(state.token_ids)
            with self._threads(len(states)):
                drafted = module.draft_chain(
                    self.model.decoder_stack.native,
                    embedding,
                    head,
                    torch.tensor(tokens, dtype=torch.long),
                    *self._chain_arguments(layout, metadata, num_tokens),
                ).T.tolist()
            for state, chain in zip(states, drafted):
                proposals[state.req_id].extend(chain)
            remember_fed_tokens(states, proposals, num_tokens)
            return True
        positions = layout  # the tensors below share memory with these arrays
        slots, lens = metadata.slot_mapping.numpy(), step.seq_lens.numpy()
        position_tensor = torch.from_numpy(positions)
        ids = np.zeros(len(states), dtype=np.int64)
        ids_tensor = torch.from_numpy(ids)
        tables = [s.block_ids for s in states]
        size = self.block_size
        for offset in range(1, num_tokens):
            for i, state in enumerate(states):
                position = len(state.token_ids) - 1 + offset
                positions[i], lens[i], ids[i] = position, position + 1, tokens[i]
                slots[i] = tables[i][position // size] * size + position % size
            with self._threads(len(states)):
                hidden = self.model(ids_tensor, position_tensor, self.kv_caches, metadata)
                tokens = argmax_rows(self.model.compute_logits(hidden)).tolist()
            for state, token in zip(states, tokens):
                proposals[state.req_id].append(token)
        remember_fed_tokens(states, proposals, num_tokens)
        return True

    def _whole_proposal(
        self, states: list[CachedRequestState], num_tokens: int
    ) -> dict[str, list[int]] | None:
        """The catch-up forward and the chain in one native call (`draft_proposal`), where
        every request catches up completely in one forward (the caller checks) and has room
        for the whole chain; its layouts from Python ints. None (nothing done) elsewhere."""
        native = self._native_chain() if self.fold_catch_up else None
        stack = self.model.decoder_stack
        if native is None or stack is None or not hasattr(native[0], "draft_proposal"):
            return None
        lengths = [len(s.token_ids) for s in states]
        last = [n - 1 + num_tokens - 1 for n in lengths]  # the chain's last fed position
        if not all(self._has_slot(s, p) for s, p in zip(states, last)):
            return None
        layout, metadata = layout_decode(
            [s.block_ids for s in states],
            [p + 1 for p in last],
            self.block_size,
            self.sliding_window,
            self.device,
        )
        step = metadata.step
        if step is None or not stack.applies(metadata, self.kv_caches):
            return None
        size = self.block_size
        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        query_start = [0]
        for i, state in enumerate(states):
            start, table = state.num_draft_computed_tokens, state.block_ids
            ids += state.token_ids[start:]
            positions += range(start, lengths[i])
            slots += [table[p // size] * size + p % size for p in range(start, lengths[i])]
            query_start.append(len(ids))
            layout[i] = lengths[i]  # chain step 0's position: the first draft's
        module, embedding, head = native
        with self._threads(max(len(ids), len(states))):
            drafted = module.draft_proposal(
                stack.native,
                embedding,
                head,
                torch.tensor(ids, dtype=torch.long),
                torch.tensor(positions, dtype=torch.long),
                torch.tensor(slots, dtype=torch.long),
                torch.tensor(query_start, dtype=torch.int32),
                torch.tensor(lengths, dtype=torch.int32),
                *self._chain_arguments(layout, metadata, num_tokens),
            ).T.tolist()
        proposals: dict[str, list[int]] = {}
        for state, chain in zip(states, drafted):
            state.num_draft_computed_tokens = len(state.token_ids)
            proposals[state.req_id] = chain
        remember_fed_tokens(states, proposals, num_tokens)
        return proposals

    def _chain_arguments(
        self, layout: np.ndarray, metadata: AttentionMetadata, num_tokens: int
    ) -> list[Any]:
        """The native chain's arguments after its first tokens: the chain's step layout
        (`layout_decode`'s, positions at chain step 0), the draft's KV, k - 1 steps."""
        step = metadata.step
        assert step is not None
        return [
            torch.from_numpy(layout),
            metadata.slot_mapping,
            step.query_start_loc,
            step.seq_lens,
            step.block_tables,
            self.kv_caches,
            self.block_size,
            num_tokens - 1,
        ]

    def _native_chain(self) -> tuple[Any, torch.Tensor, Any] | None:
        """(the native module, the embedding table, the LM head's `PackedLinear`) where the
        whole chain can run natively: a CPU model on the fused stack, one rank, no embedding
        scale or logit soft-cap, an LM head one native product; else None. The embedding
        table is materialised once (small drafts only: at most 2**26 elements)."""
        if self._native is False:
            return None
        if self._native is None:
            self._native = self._build_native_chain() or False
        return self._native or None

    def _build_native_chain(self) -> tuple[Any, torch.Tensor, Any] | None:
        model, module = self.model, native_kernels()
        head = model.lm_head
        if (
            module is None
            or not hasattr(module, "draft_chain")
            or self.device.type != "cpu"
            or model.decoder_stack is None
            or model.tp.size > 1
            or model.kv_layer_groups is not None
            or model.traits.embedding_scale is not None
            or model.traits.final_logit_softcap is not None
            or not isinstance(head, Linear)
            or model.shape.vocab_size * model.shape.hidden_size > 2**26
        ):
            return None
        linear = head.quant_method.native_linear(head)
        if isinstance(linear, list):
            linear = linear[0] if len(linear) == 1 else None
        if linear is None:
            return None
        vocab = torch.arange(model.shape.vocab_size, device=self.device)
        embedding = model.embed_tokens(vocab).contiguous()
        return module, embedding, linear

    def _threads(self, rows: int) -> AbstractContextManager[None]:
        """One torch thread for a forward of few rows (`one_thread_rows`), else the engine's."""
        return torch_threads(1 if rows <= self.one_thread_rows else None)

    def _has_slot(self, state: CachedRequestState, position: int) -> bool:
        return position < len(state.block_ids) * self.block_size and position < self.max_position

    def _catch_up(self, ends: list[tuple[CachedRequestState, int]]) -> dict[str, int]:
        """Run the draft over each request's tokens it has no KV for, up to the given end;
        for requests brought up to their last token, return the greedy next token. Positions
        after a request's last token hold the previous proposals' KV, which may be wrong:
        they are never counted."""
        first_tokens: dict[str, int] = {}
        pieces: list[Piece] = []
        room = CATCH_UP_TOKENS_PER_FORWARD
        for state, end in ends:
            start = state.num_draft_computed_tokens
            while start < end:
                if room == 0:
                    first_tokens.update(self._forward_pieces(pieces))
                    pieces, room = [], CATCH_UP_TOKENS_PER_FORWARD
                count = min(end - start, room)
                pieces.append((state, start, start + count))
                start, room = start + count, room - count
            state.num_draft_computed_tokens = end
        first_tokens.update(self._forward_pieces(pieces))
        return first_tokens

    def _forward_pieces(self, pieces: list[Piece]) -> dict[str, int]:
        """One forward over the pieces; the greedy next token of each piece that ends at its
        request's last token."""
        if not pieces:
            return {}
        pieces = sorted(pieces, key=lambda p: attention_group_key(p[2] - p[1], p[2]))
        query_lens = np.array([end - start for _, start, end in pieces], dtype=np.int64)
        seq_lens = np.array([end for _, _, end in pieces], dtype=np.int64)
        input_ids = [t for state, start, end in pieces for t in state.token_ids[start:end]]
        last_rows = np.cumsum(query_lens) - 1
        finishing = [i for i, (s, _, end) in enumerate(pieces) if end == len(s.token_ids)]
        with self._threads(len(input_ids)):
            hidden = self._forward([p[0] for p in pieces], input_ids, query_lens, seq_lens)
            if not finishing:
                return {}
            rows = torch.from_numpy(last_rows[finishing]).to(self.device)
            next_tokens = argmax_rows(self.model.compute_logits(hidden[rows])).tolist()
        return {pieces[i][0].req_id: t for i, t in zip(finishing, next_tokens)}

    def _decode_step(
        self, states: list[CachedRequestState], tokens: list[int], positions: list[int]
    ) -> list[int]:
        """One token a request: the runner's decode layout (Python ints, no per-step numpy
        work) and the native argmax, as a chain step costs less than a third of a target
        step and per-call overhead is most of it."""
        layout, metadata = layout_decode(
            [s.block_ids for s in states],
            [p + 1 for p in positions],
            self.block_size,
            self.sliding_window,
            self.device,
        )
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        with self._threads(len(tokens)):
            hidden = self.model(
                ids, torch.from_numpy(layout).to(self.device), self.kv_caches, metadata
            )
            return argmax_rows(self.model.compute_logits(hidden)).tolist()

    def _forward(
        self,
        states: list[CachedRequestState],
        input_ids: list[int],
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
    ) -> torch.Tensor:
        positions, metadata = layout_step(
            [s.block_ids for s in states],
            query_lens,
            seq_lens,
            self.block_size,
            self.sliding_window,
            self.device,
        )
        return self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.from_numpy(positions).to(self.device),
            self.kv_caches,
            metadata,
        )


def remember_fed_tokens(
    states: list[CachedRequestState], proposals: dict[str, list[int]], num_tokens: int
) -> None:
    """After a whole chain: each request's first chain position (its length: the catch-up
    ended there) and the k - 1 drafts the chain fed from it, whose KV the draft wrote."""
    for state in states:
        state.draft_fed = (len(state.token_ids), proposals[state.req_id][: num_tokens - 1])


def credit_fed_tokens(state: CachedRequestState) -> None:
    """Count the chain's KV of the drafts the target accepted as computed, so the catch-up
    runs over the bonus token (and an accepted last draft, which no chain step fed) instead
    of every accepted token: at k = 4 a 1-2 row forward instead of up to 5. Each such
    position holds the KV of the very token now there, at that position, over the same
    prefix, as the catch-up would write it. The last token is never credited: the catch-up
    runs over it for the first draft's logits."""
    fed, state.draft_fed = state.draft_fed, None
    if fed is None or state.num_draft_computed_tokens != fed[0]:
        return
    start, tokens = fed
    limit = min(len(tokens), len(state.token_ids) - 1 - start)
    matched = 0
    while matched < limit and state.token_ids[start + matched] == tokens[matched]:
        matched += 1
    state.num_draft_computed_tokens = start + matched
