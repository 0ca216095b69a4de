"""The per-token LoRA product after the base one (Punica's SGMV: shrink by A, expand by B),
for a step whose rows are grouped into segments of one adapter slot each.

`add_lora_reference_` is the torch reference; the native CPU kernel (kernels/lora.py) computes
the same sums where it takes the tensors (float32 on the CPU), and the reference runs
elsewhere."""

from __future__ import annotations

import torch

from tokenmill.kernels.lora import native_lora_available, native_lora_shrink_expand

# (first row, end row, slot): rows [first, end) run with the adapter in `slot`.
Segment = tuple[int, int, int]


def add_lora_reference_(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, segments: list[Segment]
) -> None:
    """`y[rows] += (x[rows] @ a[slot]^T) @ bt[slot]` for each segment, in place.
    `a`: `[slots, W, in]`, `bt`: `[slots, W, out]` (B transposed, the scaling folded in)."""
    for first, end, slot in segments:
        y[first:end] += (x[first:end] @ a[slot].T) @ bt[slot]


def add_lora_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    bt: torch.Tensor,
    segments: list[Segment],
    segment_tensor: torch.Tensor | None,
) -> None:
    """As `add_lora_reference_`, through the native kernel where it takes these tensors
    (`segment_tensor`: the segments as an int64 `[n, 3]` CPU tensor, built once a step)."""
    if segment_tensor is not None and native_lora_available(y, x, a):
        native_lora_shrink_expand(y, x, a, bt, segment_tensor)
    else:
        add_lora_reference_(y, x, a, bt, segments)
