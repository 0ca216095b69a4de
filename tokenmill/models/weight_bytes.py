"""How many bytes of weights a loaded model holds in memory: what tensor parallelism reports
per rank and the quantized-weights benchmark sets beside the checkpoint file's size."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.kernels.int_linear import PackedWeight


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight tensor the model holds, each storage once (a tied head and its
    embedding, a native linear over a layer's tensors): parameters, the packed weights a dense
    CPU linear keeps outside them, and quantized layers' packed codes, scales and offsets; not
    the rotary tables (computed, not loaded: every tensor-parallel rank holds them whole)."""
    tensors: dict[int, torch.Tensor] = {}

    def hold(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        tensors[storage.data_ptr()] = tensor

    for name, module in model.named_modules():
        if name.startswith("rotary") or ".rotary" in name:
            continue
        # A mixed layer's parts (quantization/mixed_parts.py) are its own, not submodules.
        parts = [p for p in getattr(module, "parts", ()) if isinstance(p, torch.nn.Module)]
        for owner in (module, *parts):
            _hold_weights(owner, hold)
    return sum(t.untyped_storage().nbytes() for t in tensors.values())


def _hold_weights(module: torch.nn.Module, hold: Callable[[torch.Tensor], None]) -> None:
    """`hold` every weight tensor `module` itself holds."""
    for value in [*module.parameters(recurse=False), *vars(module).values()]:
        if isinstance(value, torch.Tensor):
            hold(value)
        elif isinstance(value, PackedWeight):
            for part in (value.codes, value.scales, value.offsets):
                if part is not None:
                    hold(part)
