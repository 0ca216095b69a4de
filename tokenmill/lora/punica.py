"""The per-token LoRA product after the base one (Punica's SGMV: shrink by A, expand by B),
for a step whose rows are grouped into segments of one adapter slot each.

`add_lora_` is the torch reference; the native CPU kernel (kernels/lora.py) computes the same
sum segment by segment where it builds, and the reference runs elsewhere."""

from __future__ import annotations

import torch

from tokenmill.kernels.lora import native_lora_available, native_lora_shrink_expand

# (first row, end row, slot): rows [first, end) run with the adapter in `slot`.
Segment = tuple[int, int, int]


def add_lora_reference_(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: list[Segment]
) -> None:
    """`y[rows] += (x[rows] @ a[slot]^T) @ b[slot]^T` for each segment, in place.
    `a`: `[slots, R, in]`, `b`: `[slots, out, R]` (the adapter's scaling folded into b)."""
    for first, end, slot in segments:
        shrunk = x[first:end] @ a[slot].T
        y[first:end] += shrunk @ b[slot].T


def add_lora_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    segments: list[Segment],
    segment_tensor: torch.Tensor | None,
) -> None:
    """As `add_lora_reference_`, through the native kernel where it takes these tensors
    (`segment_tensor`: the segments as an int64 `[n, 3]` CPU tensor, built once a step)."""
    if segment_tensor is not None and native_lora_available(x, a, y):
        native_lora_shrink_expand(y, x, a, b, segment_tensor)
    else:
        add_lora_reference_(y, x, a, b, segments)
