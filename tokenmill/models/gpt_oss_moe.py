"""gpt-oss's mixture-of-experts block, which differs from `FusedMoE`'s (layers/fused_moe.py)
in every part: the router has a bias and takes the top k logits before a softmax over just
those; every expert's two products have biases; the activation is a clamped SwiGLU,
`(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)`, its
gate and up columns interleaved (even and odd) as the checkpoints store them.

The experts are held stacked as the checkpoints store them, `[experts, out, in]`, either in
the model's float dtype or, for an MXFP4 checkpoint, as its 4-bit blocks and scales
(quantization/mxfp4.py), expanded one active expert at a time. They run in torch, one pair of
products per active expert; the native MoE kernel (kernels/moe.py) computes SiLU-gated experts
without biases and is not used here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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
        # MXFP4 experts' native 5-bit products (gate_up, down), packed at an expert's first
        # bfloat16 step on the CPU; None: that expert expands its blocks instead.
        self._native: dict[int, tuple[Any, Any] | None] = {}

    def weight(self, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s `name` product weight `[out, in]` in `dtype`."""
        if not self.shape.mxfp4:
            return getattr(self, name)[expert]
        blocks = getattr(self, f"{name}_blocks")[expert]
        return mxfp4.dequantize(blocks, getattr(self, f"{name}_scales")[expert], dtype)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        limit = self.shape.limit
        gate = gate_up[..., ::2].clamp(max=limit)
        up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.shape.alpha))

    def native_products(self, index: int, x: torch.Tensor) -> tuple[Any, Any] | None:
        """Expert `index`'s native products for inputs like `x`: an MXFP4 expert in a
        bfloat16 model on the CPU (float32 models keep the exact expansion, the reference)."""
        if not self.shape.mxfp4 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return None
        if index not in self._native:
            products = [
                mxfp4.native_linear(
                    getattr(self, f"{name}_blocks")[index], getattr(self, f"{name}_scales")[index]
                )
                for name in ("gate_up_proj", "down_proj")
            ]
            both = products[0] is not None and products[1] is not None
            self._native[index] = (products[0], products[1]) if both else None
        return self._native[index]

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        native = self.native_products(index, x)
        if native is not None:
            gate_up = native[0].forward(x.contiguous(), self.gate_up_proj_bias[index], False)
            return native[1].forward(
                self.activation(gate_up).contiguous(), self.down_proj_bias[index], False
            )
        gate_up = F.linear(
            x, self.weight("gate_up_proj", index, x.dtype), self.gate_up_proj_bias[index]
        )
        down = self.weight("down_proj", index, x.dtype)
        return F.linear(self.activation(gate_up), down, self.down_proj_bias[index])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert ids[t, j] (x[t]), as `torch_experts` groups it."""
        calls = [partial(self.expert, index) for index in range(self.shape.num_experts)]
        return torch_experts(x, weights, ids, calls)


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
