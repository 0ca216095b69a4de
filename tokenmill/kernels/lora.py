"""The native segmented LoRA shrink/expand (kernels/csrc/lora.cpp): for each segment of rows
with one adapter slot, `y += (x A^T) B^T`, threaded over rows and outputs. float32 only; the
torch reference (lora/punica.py) runs everything else."""

from __future__ import annotations

import torch

from tokenmill.kernels.native import native_kernels


def native_lora_available(x: torch.Tensor, a: torch.Tensor, y: torch.Tensor) -> bool:
    if not (x.device.type == "cpu" and x.dtype == a.dtype == y.dtype == torch.float32):
        return False
    kernels = native_kernels()
    return kernels is not None and hasattr(kernels, "lora_shrink_expand")


def native_lora_shrink_expand(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: torch.Tensor
) -> None:
    kernels = native_kernels()
    assert kernels is not None
    kernels.lora_shrink_expand(y, x.contiguous(), a, b, segments)
