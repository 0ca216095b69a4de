"""Several linears over one input (a hybrid layer's input products: models/gated_deltanet.py,
models/hybrid.py) with adjacent parts of one weight format merged into one product: one read
of the input and one kernel call instead of one a part.

The merge runs on the loaded weights before the linears are processed
(`process_weights_after_loading`), where every method this module merges (dense float, int8
groups, int4 groups: `MERGEABLE`) holds its weight as tensors whose rows are the output rows
(`weight`; `qvalues` / `qscales` / `qzeros`; `qweight` / `scales` / `offsets`), so the merged
weight is the parts' rows stacked: exact for every format, a GGUF file's K-quant blocks
included (they load as int4 / int6 groups of whole rows). The merged layer is then packed as
any other, its product its parts' side by side bit for bit (the kernels compute each row
block alone). Parts of other formats (a Q4_K_M file's Q6_K `attn_qkv` beside Q4_K
`attn_gate`) stay a product of their own.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.linear import DenseLinearMethod, Linear, LinearMethod
from tokenmill.quantization.int4 import Int4LinearMethod
from tokenmill.quantization.int8 import Int8LinearMethod

MERGEABLE = (DenseLinearMethod, Int4LinearMethod, Int8LinearMethod)


class MergedProducts(nn.Module):
    """`forward(x)` is `[part(x) for part in parts]`, computed run by run: each run one
    linear whose output is its parts' side by side (`sizes`: their widths), split into
    views (column slices of the run's output, not contiguous when a run has several)."""

    def __init__(self, runs: list[nn.Module], sizes: list[list[int]]) -> None:
        super().__init__()
        self.runs = nn.ModuleList(runs)
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        for run, sizes in zip(self.runs, self.sizes, strict=True):
            out = run(x)
            outs.extend(out.split(sizes, dim=-1) if len(sizes) > 1 else (out,))
        return outs


def merge_products(parts: list[nn.Module], merge: bool = True) -> MergedProducts:
    """`parts` (loaded, not yet processed) as `MergedProducts`: adjacent parts that
    `can_merge` in one linear (the parts' storage moved into it), the others alone.
    `merge` False: every part alone (A/B runs)."""
    runs: list[list[nn.Module]] = []
    for part in parts:
        if merge and runs and can_merge(runs[-1][-1], part):
            runs[-1].append(part)
        else:
            runs.append([part])
    return MergedProducts(
        [run[0] if len(run) == 1 else _stacked(run) for run in runs],
        [[_width(part) for part in run] for run in runs],
    )


def can_merge(first: nn.Module, second: nn.Module) -> bool:
    """Whether two loaded linears' weights stack into one: the same method class
    (`MERGEABLE`) and format, input width, dtype, bias or none, and the same row-major
    tensors."""
    if not (isinstance(first, Linear) and isinstance(second, Linear)):
        return False
    a, b = first.quant_method, second.quant_method
    return (
        isinstance(a, MERGEABLE)
        and type(a) is type(b)
        and _method_key(a) == _method_key(b)
        and first.in_features == second.in_features
        and first.dtype == second.dtype
        and (first.bias is None) == (second.bias is None)
        and _row_tensors(first).keys() == _row_tensors(second).keys()
        and all(
            t.shape[1:] == _row_tensors(second)[name].shape[1:]
            and t.dtype == _row_tensors(second)[name].dtype
            for name, t in _row_tensors(first).items()
        )
    )


def _method_key(method: LinearMethod) -> tuple[object, ...]:
    """What must agree between two methods whose parts share one packed weight."""
    codebook = getattr(method, "codebook", None)
    return (
        method.weight_format,
        getattr(method, "dequantize_on", None),
        getattr(method, "fallback", None) is None,
        None if codebook is None else tuple(codebook.tolist()),
    )


def _row_tensors(layer: Linear) -> dict[str, torch.Tensor]:
    """The layer's weight storage before processing: every parameter and buffer but the
    bias, each `[out_features, ...]`; empty when any is not row-major (not mergeable)."""
    tensors = {
        name: t
        for name, t in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
        if name != "bias"
    }
    if any(t.dim() < 1 or t.shape[0] != layer.out_features for t in tensors.values()):
        return {}
    return tensors


def _width(part: nn.Module) -> int:
    return int(part.out_features)  # type: ignore[arg-type]


def _stacked(run: list[nn.Module]) -> Linear:
    """One linear holding `run`'s rows in order."""
    first = run[0]
    assert isinstance(first, Linear) and _row_tensors(first)
    rows = sum(_width(part) for part in run)
    bias = None
    if first.bias is not None:
        bias = nn.Parameter(torch.cat([part.bias.detach() for part in run]), requires_grad=False)
    merged = Linear(first.in_features, rows, first.quant_method, bias=bias, dtype=first.dtype)
    targets = _row_tensors(merged)
    for name, target in targets.items():
        torch.cat([_row_tensors(part)[name].detach() for part in run], out=target.data)
    return merged
