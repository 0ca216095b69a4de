"""The native segmented LoRA shrink/expand (kernels/csrc/lora.cpp): for each segment of rows
with one adapter slot, `y += (x A^T) B^T`, on the worker pool, with AVX2 and AVX-512 paths.
float32 on the CPU only; the torch reference (lora/punica.py) runs everything else."""

from __future__ import annotations

import torch

from tokenmill.kernels.native import native_kernels


def native_lora_available(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: float32 on the CPU, `y` contiguous (it is
    written in place), and the kernels built."""
    if not (x.device.type == "cpu" and x.dtype == a.dtype == y.dtype == torch.float32):
        return False
    if not y.is_contiguous():
        return False
    kernels = native_kernels()
    return kernels is not None and hasattr(kernels, "lora_shrink_expand")


def native_lora_shrink_expand(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, segments: torch.Tensor
) -> None:
    """`y[first:end] += (x[first:end] @ a[slot]^T) @ bt[slot]` per row of `segments`
    (`[n, 3]` int64: first, end, slot), in place."""
    kernels = native_kernels()
    assert kernels is not None
    kernels.lora_shrink_expand(y, x.contiguous(), a, bt, segments)
