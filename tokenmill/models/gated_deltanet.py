"""The gated DeltaNet layer of Qwen3.5 and Qwen3-Next (transformers' `Qwen3_5GatedDeltaNet`,
`Qwen3NextGatedDeltaNet`) over a step's flat tokens and the linear-state cache.

Projections (q, k, v together; the output gate z; beta's and the decay's inputs b, a) run on
every token of the step at once; then the causal depthwise conv1d (kernel 4, SiLU) and the gated
delta rule run per sequence from its slot's states (layers/linear_state.py): the step's leading
one-token rows (decodes) together, in the native kernel where it builds
(kernels/gated_delta.py), each longer prompt chunk in the native prefill kernel (or, where it
does not build, the chunked form: layers/gated_delta_rule.py). The output is RMS-normed per
head, gated by SiLU(z), projected.

Qwen3-Next stores q, k, v, z fused per key-head group (`in_proj_qkvz`, `in_proj_ba`); Qwen3.5
stores them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.gated_delta import (
    decode_delta_rule_,
    fused_decode_,
    fused_decode_applies,
    fused_hybrid_enabled,
    native_prefill_applies,
    prefill_delta_rule_,
)
from tokenmill.layers.gated_delta_rule import chunked_delta_rule, normalize_qk, recurrent_step_
from tokenmill.layers.linear_state import LinearStateCache, LinearStateSpec
from tokenmill.models.merged_products import MergedProducts, merge_products


def linear_state_spec(hf_config: Any, num_layers: int, dtype: torch.dtype) -> LinearStateSpec:
    key_dim = hf_config.linear_key_head_dim * hf_config.linear_num_key_heads
    value_dim = hf_config.linear_value_head_dim * hf_config.linear_num_value_heads
    return LinearStateSpec(
        num_layers=num_layers,
        conv_dim=2 * key_dim + value_dim,
        conv_kernel=hf_config.linear_conv_kernel_dim,
        num_v_heads=hf_config.linear_num_value_heads,
        k_dim=hf_config.linear_key_head_dim,
        v_dim=hf_config.linear_value_head_dim,
        conv_dtype=dtype,
    )


class GatedRMSNorm(nn.Module):
    """RMS norm per head, then times SiLU(gate) (transformers' `Qwen3_5RMSNormGated`)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype) * self.weight
        return (normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hf_config: Any, layer_index: int, fused_projections: bool) -> None:
        """`layer_index`: among the model's linear-attention layers (its slot tensors)."""
        super().__init__()
        c = hf_config
        self.layer_index = layer_index
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.k_dim, self.v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_size = self.k_dim * self.num_k_heads
        self.value_size = self.v_dim * self.num_v_heads
        self.conv_dim = 2 * self.key_size + self.value_size
        kernel = c.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False
        )
        self.fused_projections = fused_projections
        hidden, heads = c.hidden_size, self.num_v_heads
        if fused_projections:  # Qwen3-Next
            self.in_proj_qkvz = nn.Linear(hidden, self.conv_dim + self.value_size, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * heads, bias=False)
        else:  # Qwen3.5
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_size, bias=False)
            self.in_proj_b = nn.Linear(hidden, heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(self.v_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False)
        self.states: LinearStateCache | None = None  # set by the model's `use_state_cache`
        self.in_proj_all: MergedProducts | None = None  # the input products (`after_loading`)
        self.decay_params: tuple[torch.Tensor, torch.Tensor] | None = None

    def after_loading(self) -> None:
        """Before the linears are processed: the input products (Qwen3.5's four, Qwen3-Next's
        two) merged where adjacent ones share a format (`merge_products`; the parts move
        into `in_proj_all`), and A_log / dt_bias kept in float32 for the fused decode (one
        conversion, not two ops a layer a step)."""
        self.decay_params = (self.A_log.detach().float(), self.dt_bias.detach().float())
        if self.fused_projections:
            parts = [self.in_proj_qkvz, self.in_proj_ba]
            del self.in_proj_qkvz, self.in_proj_ba
        else:
            parts = [self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a]
            del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        self.in_proj_all = merge_products(parts, fused_hybrid_enabled())

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v `[tokens, conv_dim]`, z `[tokens, v_heads, v_dim]`, b, a `[tokens, v_heads]`)."""
        assert self.in_proj_all is not None, "after_loading merges the input products"
        tokens = x.shape[0]
        if not self.fused_projections:
            mixed, z, b, a = self.in_proj_all(x)
            return mixed, z.view(tokens, self.num_v_heads, self.v_dim), b, a
        # Per key head: q, k (k_dim each), then its group's v and z; b and a likewise.
        group = self.num_v_heads // self.num_k_heads
        qkvz, ba = self.in_proj_all(x)
        qkvz = qkvz.view(tokens, self.num_k_heads, -1)
        q, k, v, z = qkvz.split(
            [self.k_dim, self.k_dim, group * self.v_dim, group * self.v_dim], -1
        )
        b, a = ba.reshape(tokens, self.num_k_heads, 2 * group).split(group, -1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], -1)
        z = z.reshape(tokens, self.num_v_heads, self.v_dim)
        return mixed, z, b.reshape(tokens, -1), a.reshape(tokens, -1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.states is not None and self.states.step is not None
        step, index = self.states.step, self.layer_index
        conv_states, recurrent = self.states.conv[index], self.states.recurrent[index]
        mixed, z, b, a = self._project(hidden)
        weight = self.conv1d.weight[:, 0]  # [conv_dim, kernel]
        tokens, rows = hidden.shape[0], step.num_decodes
        fused = bool(rows) and fused_decode_applies(mixed, z, b, a, weight, conv_states,
                                                    self.norm.weight)  # fmt: skip
        gated_decodes = None
        if fused:  # the decode rows' conv, rule and gated norm in one native call
            a_log, dt_bias = self.decay_params or (self.A_log, self.dt_bias)
            gated_decodes = fused_decode_(
                mixed[:rows], z[:rows], b[:rows], a[:rows], a_log, dt_bias, weight,
                conv_states, recurrent, step.decode_slots, self.norm.weight,
                self.num_k_heads, self.norm.eps,
            )  # fmt: skip
        if gated_decodes is not None and rows == tokens:
            decay = beta = None  # a decode-only step: nothing below reads them
        else:
            beta = b.float().sigmoid()
            decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = None  # the rule's float32 output, for the rows the fused call does not gate
        if gated_decodes is None or rows < tokens:
            out = hidden.new_empty((tokens, self.num_v_heads, self.v_dim), dtype=torch.float32)
        if rows and not fused:
            assert decay is not None and beta is not None and out is not None
            # index_select / index_copy_, not `conv_states[slots]`: advanced indexing of the
            # pool took ~10 ms a layer on a loaded 2-core machine (its parallel kernel).
            slots = step.decode_slots
            window = torch.cat([conv_states.index_select(0, slots), mixed[:rows, :, None]], -1)
            conv_states.index_copy_(0, slots, window[..., 1:].contiguous())
            qkv = F.silu((window.float() * weight.float()).sum(-1)).to(mixed.dtype)
            q, k, v = self._split_heads(qkv)
            out[:rows] = decode_delta_rule_(
                q, k, v, decay[:rows], beta[:rows], recurrent, step.decode_slots
            )
        snapshots = self.states.snapshots
        for i, (_, snapshot) in step.cuts.items():  # a decode row ending a block
            if i < rows and snapshots is not None:
                slot = step.slots[i]
                snapshots.save(index, snapshot, conv_states[slot], recurrent[slot])
        for i in range(rows, len(step.slots)):
            assert decay is not None and beta is not None and out is not None
            start, end, slot = step.row_starts[i], step.row_starts[i + 1], step.slots[i]
            if i in step.verifying:
                out[start:end] = self._verify(mixed[start:end], decay[start:end],
                                              beta[start:end], slot, weight, i)  # fmt: skip
                continue
            cut = step.cuts.get(i)  # a prompt chunk, in two parts around a block boundary
            split = end if cut is None else start + cut[0]
            out[start:split] = self._chunk(mixed, decay, beta, start, split, slot, weight)
            if cut is not None and snapshots is not None:
                snapshots.save(index, cut[1], conv_states[slot], recurrent[slot])
            if split < end:
                out[split:end] = self._chunk(mixed, decay, beta, split, end, slot, weight)
        if gated_decodes is None:
            assert out is not None
            gated = self.norm(out.to(hidden.dtype), z).reshape(tokens, self.value_size)
        elif rows == tokens:
            gated = gated_decodes
        else:
            assert out is not None
            rest = self.norm(out[rows:].to(hidden.dtype), z[rows:])
            gated = torch.cat([gated_decodes, rest.reshape(tokens - rows, self.value_size)])
        return self.out_proj(gated)

    def _chunk(
        self,
        mixed: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
        start: int,
        end: int,
        slot: int,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        """Rows [start, end) of one sequence, in the chunked form, from its slot's states."""
        assert self.states is not None
        conv_state = self.states.conv[self.layer_index][slot]
        q, k, v = self._split_heads(self._conv_sequence(mixed[start:end], conv_state, weight))
        state = self.states.recurrent[self.layer_index][slot]
        if native_prefill_applies(q, state):
            return prefill_delta_rule_(q, k, v, decay[start:end], beta[start:end], state)
        return chunked_delta_rule(
            *normalize_qk(q, k, self.num_v_heads), v, decay[start:end], beta[start:end], state
        )

    def _verify(
        self,
        mixed: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
        slot: int,
        weight: torch.Tensor,
        sequence: int,
    ) -> torch.Tensor:
        """A sequence verifying drafts, token by token: the states after each row are kept
        (`LinearStateCache.positions`) so `accept` can roll back the rejected ones."""
        assert self.states is not None
        conv_state = self.states.conv[self.layer_index][slot]
        tokens, width = mixed.shape[0], conv_state.shape[-1]
        padded = torch.cat([conv_state, mixed.transpose(0, 1)], dim=-1)
        conv_positions = padded.unfold(1, width, 1)[:, 1:].transpose(0, 1).clone()
        q, k, v = self._split_heads(self._conv_sequence(mixed, conv_state, weight))
        q, k = normalize_qk(q, k, self.num_v_heads)
        state = self.states.recurrent[self.layer_index][slot : slot + 1]
        positions = state.new_empty((tokens, *state.shape[1:]))
        out = v.new_empty(v.shape, dtype=torch.float32)
        for t in range(tokens):
            row = slice(t, t + 1)
            v_row = v[row].float()
            out[t] = recurrent_step_(q[row], k[row], v_row, decay[row], beta[row], state)[0]
            positions[t] = state[0]
        self.states.positions[self.layer_index][sequence] = (conv_positions, positions)
        return out

    def _split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (
            q.reshape(tokens, self.num_k_heads, self.k_dim),
            k.reshape(tokens, self.num_k_heads, self.k_dim),
            v.reshape(tokens, self.num_v_heads, self.v_dim),
        )

    @staticmethod
    def _conv_sequence(
        x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """One sequence's tokens `[tokens, conv_dim]` through the causal conv from its state
        `[conv_dim, kernel - 1]` (updated in place to its last kernel - 1 inputs)."""
        padded = torch.cat([conv_state, x.transpose(0, 1)], dim=-1)  # [conv_dim, K - 1 + T]
        conv_state.copy_(padded[:, padded.shape[1] - conv_state.shape[1] :])
        # The taps summed in float32 (F.conv1d in bfloat16 went to oneDNN's slow path: ~60 ms
        # a layer for a few tokens on an AVX2 machine).
        padded, taps = padded.float(), weight.float()
        tokens, kernel = x.shape[0], weight.shape[1]
        out = padded[:, :tokens] * taps[:, :1]
        for tap in range(1, kernel):
            out.addcmul_(padded[:, tap : tap + tokens], taps[:, tap : tap + 1])
        return F.silu(out).transpose(0, 1).to(x.dtype)
