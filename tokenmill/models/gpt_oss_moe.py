"""gpt-oss's mixture-of-experts block, which differs from `FusedMoE`'s (layers/fused_moe.py)
in every part: the router has a bias and takes the top k logits before a softmax over just
those; every expert's two products have biases; the activation is a clamped SwiGLU,
`(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`, its
gate and up columns interleaved (even and odd) as the checkpoints store them.

The experts are held stacked as the checkpoints store them, `[experts, out, in]`, either in
the model's float dtype or, for an MXFP4 checkpoint, as its 4-bit blocks and scales
(quantization/mxfp4.py). On the CPU they run in the native MoE kernel (kernels/moe.py, with
the experts' biases and the clamped SwiGLU): float experts packed dense, MXFP4 ones in a
bfloat16 model as exact 5-bit codes; elsewhere in torch, one pair of products per active
expert, MXFP4 expanded one active expert at a time (the reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels import moe
from tokenmill.kernels.linear import native_dense_linear, pack_linear_weight
from tokenmill.kernels.moe import ExpertsKernel
from tokenmill.layers.fused_moe import torch_experts
from tokenmill.quantization import mxfp4


@dataclass(frozen=True)
class GptOssMoEShape:
    hidden_size: int
    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate width
    alpha: float  # swiglu_alpha
    limit: float  # swiglu_limit
    mxfp4: bool  # experts stored as MXFP4 blocks and scales


class BiasedRouter(nn.Module):
    """The router (`mlp.router`): a float32 linear with a bias, never quantized."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float(), self.bias.float())


def _stacked(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GptOssExperts(nn.Module):
    """The experts, stacked (`mlp.experts.gate_up_proj[_blocks, _scales]`, `..._bias`,
    `down_proj...`). Products are `[out, in]`: the loader transposes a float checkpoint's
    `[in, out]` (family gpt_oss's `split_tensor`); MXFP4 blocks are stored `[out, in]`."""

    def __init__(self, shape: GptOssMoEShape) -> None:
        super().__init__()
        self.shape = shape
        e, h, i = shape.num_experts, shape.hidden_size, shape.expert_size
        if shape.mxfp4:
            u8 = torch.uint8
            self.gate_up_proj_blocks = _stacked(e, 2 * i, h // mxfp4.BLOCK, 16, dtype=u8)
            self.gate_up_proj_scales = _stacked(e, 2 * i, h // mxfp4.BLOCK, dtype=u8)
            self.down_proj_blocks = _stacked(e, h, i // mxfp4.BLOCK, 16, dtype=u8)
            self.down_proj_scales = _stacked(e, h, i // mxfp4.BLOCK, dtype=u8)
        else:
            self.gate_up_proj = _stacked(e, 2 * i, h)
            self.down_proj = _stacked(e, h, i)
        self.gate_up_proj_bias = _stacked(e, 2 * i)
        self.down_proj_bias = _stacked(e, h)
        # The native MoE kernel over these experts (kernels/moe.py), made at the first
        # forward; False where it does not apply.
        self._kernel: ExpertsKernel | bool | None = None

    def weight(self, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s `name` product weight `[out, in]` in `dtype`."""
        if not self.shape.mxfp4:
            return getattr(self, name)[expert].to(dtype)
        blocks = getattr(self, f"{name}_blocks")[expert]
        return mxfp4.dequantize(blocks, getattr(self, f"{name}_scales")[expert], dtype)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        limit = self.shape.limit
        gate = gate_up[..., ::2].clamp(max=limit)
        up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.shape.alpha))

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `index` in torch (the reference path)."""
        gate_up = F.linear(
            x, self.weight("gate_up_proj", index, x.dtype), self.gate_up_proj_bias[index]
        )
        down = self.weight("down_proj", index, x.dtype)
        return F.linear(self.activation(gate_up), down, self.down_proj_bias[index])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert ids[t, j] (x[t]), as `torch_experts` groups it."""
        if self._kernel is None:
            self._kernel = self.native_kernel(x) or False
        if self._kernel is not False:
            return self._kernel(x, weights, ids)
        calls = [partial(self.expert, index) for index in range(self.shape.num_experts)]
        return torch_experts(x, weights, ids, calls)

    @property
    def uses_native_kernel(self) -> bool | None:
        """Whether the experts run in the native kernel (None: before the first forward)."""
        return None if self._kernel is None else self._kernel is not False

    def native_kernel(self, x: torch.Tensor) -> ExpertsKernel | None:
        """The native kernel for inputs like `x`, its weights packed from these experts': float
        experts in the packed dense layout, MXFP4 ones as exact 5-bit codes in a bfloat16 model
        (a float32 one keeps the exact expansion, the reference); None where it does not apply.
        The stacked weights it packs are then freed (the kernel holds the only copy)."""
        if not moe.applies_to(x) or (self.shape.mxfp4 and x.dtype != torch.bfloat16):
            return None
        products = [self.native_products(name, x.dtype) for name in ("gate_up_proj", "down_proj")]
        if products[0] is None or products[1] is None:
            return None
        biases = (list(self.gate_up_proj_bias), list(self.down_proj_bias))
        kernel = moe.moe_kernel(
            products[0],
            products[1],
            self.shape.expert_size,
            biases,
            moe.CLAMPED_SWIGLU,
            self.shape.alpha,
            self.shape.limit,
        )
        suffixes = ("_blocks", "_scales") if self.shape.mxfp4 else ("",)
        for name in ("gate_up_proj", "down_proj"):
            for suffix in suffixes:
                setattr(self, name + suffix, None)
        return kernel

    def native_products(self, name: str, dtype: torch.dtype) -> list[Any] | None:
        """Each expert's `name` product as a native `PackedLinear`, or None (an MXFP4 scale
        outside the 5-bit layout's range)."""
        products = []
        for index in range(self.shape.num_experts):
            if self.shape.mxfp4:
                blocks = getattr(self, f"{name}_blocks")[index]
                product = mxfp4.native_linear(blocks, getattr(self, f"{name}_scales")[index])
            else:
                weight = getattr(self, name)[index]
                packed = pack_linear_weight(weight.to(dtype))
                product = native_dense_linear(packed, weight.shape[0], weight.shape[1])
            if product is None:
                return None
            products.append(product)
        return products


class GptOssMoE(nn.Module):
    """A decoder layer's `mlp`: `router` and `experts`, named as in the checkpoints."""

    def __init__(self, shape: GptOssMoEShape) -> None:
        super().__init__()
        self.shape = shape
        self.router = BiasedRouter(shape.hidden_size, shape.num_experts)
        self.experts = GptOssExperts(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, ids = torch.topk(logits, self.shape.top_k, dim=-1)
        return self.experts(x, torch.softmax(top, dim=-1), ids)
