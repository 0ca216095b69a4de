"""The gated delta rule's decode step: the native kernel (`kernels/csrc/gated_delta.cpp`) where
it builds, the torch reference (`recurrent_step_`, here; the chunked form for prompt chunks is
layers/gated_delta_rule.py's) elsewhere. Prompt chunks have a native kernel too
(`prefill_delta_rule_`: token by token, each head's state kept in cache across the chunk).

The native kernel reads and writes each row's recurrent state in its slot of the pool, once:
torch gathers the slots' states, runs ~10 ops over them and scatters them back (a 32-head,
128 x 128 state is 2 MiB a sequence a layer, so each pass goes out to memory).
`TOKENMILL_NATIVE_KERNELS=0` runs the torch path.
"""

from __future__ import annotations

import os

import torch

from tokenmill.kernels.native import native_kernels


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As FLA (and transformers' `l2norm`): x / sqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def normalize_qk(
    query: torch.Tensor, key: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[tokens, k_heads, k_dim]` -> `[tokens, v_heads, k_dim]` float32, l2-normalised, the
    query scaled: each query/key head serves `v_heads // k_heads` consecutive value heads."""
    repeats = num_v_heads // query.shape[1]
    query = l2norm(query.float())
    key = l2norm(key.float())
    if repeats > 1:
        query = query.repeat_interleave(repeats, dim=1)
        key = key.repeat_interleave(repeats, dim=1)
    return query * query.shape[-1] ** -0.5, key


def recurrent_step_(
    query: torch.Tensor,  # [rows, heads, k_dim] float32, normalised
    key: torch.Tensor,  # [rows, heads, k_dim] float32, normalised
    value: torch.Tensor,  # [rows, heads, v_dim] float32
    decay: torch.Tensor,  # [rows, heads] g (log space, <= 0)
    beta: torch.Tensor,  # [rows, heads]
    state: torch.Tensor,  # [rows, heads, k_dim, v_dim] float32, updated in place
) -> torch.Tensor:
    """One token of each row: the state advanced in place; the output `[rows, heads, v_dim]`."""
    state.mul_(decay.exp()[..., None, None])
    predicted = (state * key[..., None]).sum(dim=-2)
    delta = (value - predicted) * beta[..., None]
    state.add_(key[..., None] * delta[..., None, :])
    return (state * query[..., None]).sum(dim=-2)


def native_applies(query: torch.Tensor, state_pool: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and state_pool.dtype == torch.float32
        and state_pool.is_contiguous()
        and native_kernels() is not None
        and hasattr(native_kernels(), "gated_delta_decode")
    )


def fused_hybrid_enabled() -> bool:
    """The hybrid layers' native glue is on unless `TOKENMILL_FUSED_HYBRID=0` (A/B runs)."""
    return os.environ.get("TOKENMILL_FUSED_HYBRID") != "0"


def fused_decode_applies(mixed: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether a gated DeltaNet layer's decode rows run in one native call
    (`gated_deltanet_decode`): the CPU, float32 or bfloat16 activations, every tensor of
    theirs (`tensors`: z, b, a, the conv taps and states, the norm's weight) of that dtype.
    `TOKENMILL_FUSED_HYBRID=0` runs the ops one by one (A/B measurements)."""
    module = native_kernels()
    return (
        mixed.device.type == "cpu"
        and mixed.dtype in (torch.float32, torch.bfloat16)
        and all(t.dtype == mixed.dtype for t in tensors)
        and module is not None
        and hasattr(module, "gated_deltanet_decode")
        and fused_hybrid_enabled()
    )


def native_prefill_applies(query: torch.Tensor, state: torch.Tensor) -> bool:
    return native_applies(query, state) and hasattr(native_kernels(), "gated_delta_prefill")


def prefill_delta_rule_(
    query: torch.Tensor,  # [tokens, k_heads, k_dim] (raw: not normalised)
    key: torch.Tensor,  # [tokens, k_heads, k_dim]
    value: torch.Tensor,  # [tokens, v_heads, v_dim]
    decay: torch.Tensor,  # [tokens, v_heads] float32
    beta: torch.Tensor,  # [tokens, v_heads] float32
    state: torch.Tensor,  # [v_heads, k_dim, v_dim] float32 contiguous, updated in place
) -> torch.Tensor:
    """One sequence's tokens in the native kernel (`native_prefill_applies`): the output
    `[tokens, v_heads, v_dim]` float32, the state advanced past them."""
    module = native_kernels()
    assert module is not None
    return module.gated_delta_prefill(
        query.float().contiguous(),
        key.float().contiguous(),
        value.float().contiguous(),
        decay.contiguous(),
        beta.contiguous(),
        state,
    )


def decode_delta_rule_(
    query: torch.Tensor,  # [rows, k_heads, k_dim] (raw: not normalised)
    key: torch.Tensor,  # [rows, k_heads, k_dim]
    value: torch.Tensor,  # [rows, v_heads, v_dim]
    decay: torch.Tensor,  # [rows, v_heads] float32
    beta: torch.Tensor,  # [rows, v_heads] float32
    state_pool: torch.Tensor,  # [slots, v_heads, k_dim, v_dim] float32, rows' slots updated
    slots: torch.Tensor,  # [rows] int64
) -> torch.Tensor:
    """One token of each row from its slot's state: the output `[rows, v_heads, v_dim]`
    float32 (l2-normalised q and k, q scaled by k_dim ** -0.5, as transformers)."""
    if native_applies(query, state_pool):
        module = native_kernels()
        assert module is not None
        return module.gated_delta_decode(
            query.float().contiguous(),
            key.float().contiguous(),
            value.float().contiguous(),
            decay.contiguous(),
            beta.contiguous(),
            state_pool,
            slots.contiguous(),
        )
    return decode_delta_rule_torch_(query, key, value, decay, beta, state_pool, slots)


def decode_delta_rule_torch_(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The reference: the slots' states gathered, advanced, written back."""
    q, k = normalize_qk(query, key, value.shape[1])
    state = state_pool[slots]
    out = recurrent_step_(q, k, value.float(), decay, beta, state)
    state_pool[slots] = state
    return out


def fused_decode_(
    mixed: torch.Tensor,  # [rows, conv_dim]: q|k|v before the conv
    z: torch.Tensor,  # [rows, v_heads, v_dim]
    b: torch.Tensor,  # [rows, v_heads]
    a: torch.Tensor,  # [rows, v_heads]
    a_log: torch.Tensor,  # [v_heads]
    dt_bias: torch.Tensor,  # [v_heads]
    conv_weight: torch.Tensor,  # [conv_dim, kernel]
    conv_states: torch.Tensor,  # [slots, conv_dim, kernel - 1], rows' slots shifted
    state_pool: torch.Tensor,  # [slots, v_heads, k_dim, v_dim] float32, rows' slots updated
    slots: torch.Tensor,  # [rows] int64
    norm_weight: torch.Tensor,  # [v_dim]
    k_heads: int,
    eps: float,
) -> torch.Tensor:
    """One token of each row through the conv, the delta rule and the gated norm
    (`fused_decode_applies`): `[rows, v_heads * v_dim]` in the activations' dtype, what the
    layer's output projection reads."""
    module = native_kernels()
    assert module is not None
    return module.gated_deltanet_decode(
        mixed.contiguous(),
        z.contiguous(),
        b.contiguous(),
        a.contiguous(),
        a_log.float().contiguous(),
        dt_bias.float().contiguous(),
        conv_weight.contiguous(),
        conv_states,
        state_pool,
        slots.contiguous(),
        norm_weight.contiguous(),
        k_heads,
        eps,
    )
