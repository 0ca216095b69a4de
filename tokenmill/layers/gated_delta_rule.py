"""The gated delta rule of gated DeltaNet (Qwen3.5, Qwen3-Next linear attention), in torch:
the reference the native decode kernel (kernels/gated_delta.py) is held to.

Per value head the state S is a `[k_dim, v_dim]` matrix; each token decays it by exp(g),
corrects what it predicts for the token's key towards the token's value by beta (the delta
rule), and reads it with the query:

    S = exp(g) * S;  S += k (beta * (v - k^T S));  o = q^T S

Decode runs that recurrence for one token of each sequence at once (`recurrent_step_`); a
prompt chunk runs the chunked form (`chunked_delta_rule`, transformers' algorithm: per chunk
of 64 tokens a triangular solve and a few matmuls, the state carried across chunks and, through
its slot, across a prompt's prefill chunks). Queries and keys arrive l2-normalised (queries
also scaled by k_dim ** -0.5) and float32 (`normalize_qk`), as transformers computes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.gated_delta import normalize_qk, recurrent_step_

__all__ = ["chunked_delta_rule", "normalize_qk", "recurrent_delta_rule", "recurrent_step_"]

CHUNK_SIZE = 64  # tokens per chunk of the chunked form (transformers' and FLA's)


def recurrent_delta_rule(
    query: torch.Tensor,  # [tokens, heads, k_dim]
    key: torch.Tensor,
    value: torch.Tensor,  # [tokens, heads, v_dim]
    decay: torch.Tensor,  # [tokens, heads]
    beta: torch.Tensor,
    state: torch.Tensor,  # [heads, k_dim, v_dim], updated in place
) -> torch.Tensor:
    """One sequence token by token (the reference of the chunked form)."""
    out = value.new_empty(value.shape, dtype=torch.float32)
    batch_state = state[None]
    for t in range(query.shape[0]):
        out[t] = recurrent_step_(
            query[t : t + 1],
            key[t : t + 1],
            value[t : t + 1].float(),
            decay[t : t + 1],
            beta[t : t + 1],
            batch_state,
        )[0]
    return out


def chunked_delta_rule(
    query: torch.Tensor,  # [tokens, heads, k_dim] float32, normalised
    key: torch.Tensor,
    value: torch.Tensor,  # [tokens, heads, v_dim]
    decay: torch.Tensor,  # [tokens, heads]
    beta: torch.Tensor,
    state: torch.Tensor,  # [heads, k_dim, v_dim] float32, updated in place
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """One sequence's tokens in chunks (transformers' `torch_chunk_gated_delta_rule`, one
    sequence, heads first): the output `[tokens, heads, v_dim]` float32."""
    length = query.shape[0]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (query, key, value))
    b, g = (F.pad(x.float().transpose(0, 1), (0, pad)) for x in (beta, decay))
    heads = q.shape[0]
    v_beta = v * b[..., None]
    k_beta = k * b[..., None]
    q, k, k_beta, v_beta = (
        x.reshape(heads, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    g = g.reshape(heads, -1, chunk_size).cumsum(dim=-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * g.exp()[..., None], upper=False, unitriangular=True
    )
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    current = state.float()
    for i in range(q.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ current
        out[:, i] = q[:, i] @ current + intra[:, i] @ v_new
        current = current * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    state.copy_(current)
    return out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1)
