"""The mixture-of-experts feed-forward block: a router picks `top_k` of `num_experts` expert
MLPs per token, their outputs are summed with the router's weights (plus, for Qwen2-MoE, a
shared expert scaled by a sigmoid gate).

Each expert is a pair of `Linear`s (`gate_up_proj`, `down_proj`), so its weight is stored and
multiplied by whatever method the weight-format seam chose for it (dense packed, int8, int4:
`quantization/selection.py`), and tensor parallelism shards it like a dense MLP: every rank
holds a slice of every expert's intermediate width (column-parallel gate/up, row-parallel
down), and the block's output is all-reduced once. That is tensor-parallel, not
expert-parallel, sharding: each rank's work per token is the same whatever the router picks
(expert parallelism leaves ranks idle when the chosen experts sit on one rank, which at the
batch sizes a CPU serves is most steps), and it needs no all-to-all of tokens.

Two paths compute the routed experts: `torch_experts` (the reference: tokens grouped by
expert, one product per active expert) and the native kernel (kernels/moe.py: the same in one
call per layer), used on the CPU where every expert's method has a native product.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.parallel import TensorParallel


@dataclass(frozen=True)
class MoEShape:
    """One family's MoE block. `renormalize`: the top-k weights are divided by their sum
    (Mixtral; Qwen's `norm_topk_prob`); otherwise they stay the softmax's over all experts."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate width
    renormalize: bool
    shared_expert_size: int = 0  # 0: no shared expert (Qwen2-MoE has one, with a sigmoid gate)


class RouterLinear(nn.Module):
    """A small float linear without bias (the router, the shared expert's gate): not an
    `nn.Linear`, so quantization leaves it alone, as vLLM does (routing decisions are where a
    few bits of error change which experts run). It multiplies in float32, with a float32
    copy of a bfloat16 weight (a few hundred KB): torch's bfloat16 product of one row by a
    2048 x 64 router took 11 ms on the CPU, a third of a decode step of the qwen3-moe preset,
    and float32 logits are what the softmax wants anyway."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self._float_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 `[tokens, out_features]`."""
        weight = self.weight
        if weight.dtype != torch.float32:
            if self._float_weight is None or self._float_weight.device != weight.device:
                self._float_weight = weight.detach().float()
            weight = self._float_weight
        return F.linear(x.float(), weight)


class ExpertMLP(nn.Module):
    """One expert (or the shared expert): SiLU-gated MLP, this rank's slice of its width, no
    all-reduce (the MoE block reduces once for all of them)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), then the top k, optionally renormalised: the
    weights `[tokens, k]` (float32) and expert ids `[tokens, k]`, as Mixtral and Qwen do."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def torch_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for each token t: tokens sorted by
    expert, one product per expert that has any (the reference path; gpt-oss's experts too)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    flat_weights = weights.reshape(-1).to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(experts, counts, strict=True):
        if count == 0:
            continue
        slots = order[start : start + count]
        rows = slots // top_k
        y = expert(x[rows]) * flat_weights[slots, None]
        out.index_add_(0, rows, y)
        start += count
    return out


class FusedMoE(nn.Module):
    """The MoE block of one decoder layer; parameter names follow the Hugging Face checkpoints
    (`gate` the router, `experts.{e}`, `shared_expert`, `shared_expert_gate`), expert gate/up
    stored fused like a dense MLP's."""

    def __init__(self, hidden_size: int, shape: MoEShape, tp: TensorParallel) -> None:
        super().__init__()
        self.shape = shape
        self.tp = tp
        self.gate = RouterLinear(hidden_size, shape.num_experts)
        width = tp.split(shape.expert_size, "the experts' intermediate size")
        self.experts = nn.ModuleList(
            ExpertMLP(hidden_size, width) for _ in range(shape.num_experts)
        )
        self.shared_expert: ExpertMLP | None = None
        self.shared_expert_gate: RouterLinear | None = None
        if shape.shared_expert_size:
            shared = tp.split(shape.shared_expert_size, "the shared expert's intermediate size")
            self.shared_expert = ExpertMLP(hidden_size, shared)
            self.shared_expert_gate = RouterLinear(hidden_size, 1)
        # The native kernel over this block's experts (kernels/moe.py), made on first use;
        # False where it does not apply.
        self._native: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.shape.top_k, self.shape.renormalize)
        out = self.routed_experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x)).to(x.dtype)
            out = out + gate * self.shared_expert(x)
        return self.tp.all_reduce(out)

    @property
    def uses_native_kernel(self) -> bool | None:
        """Whether the routed experts run in the native kernel (None: not decided yet, before
        the first forward)."""
        return None if self._native is None else self._native is not False

    def routed_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        if self._native is None:
            from tokenmill.kernels.moe import native_moe_experts

            self._native = native_moe_experts(self.experts, x) or False
        if self._native is not False:
            return self._native(x, weights, ids)
        return torch_experts(x, weights, ids, self.experts)
