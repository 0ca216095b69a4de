"""A fused linear whose parts arrive in different formats (a GGUF Q4_K_M file's q/k in Q4_K
beside a Q6_K `attn_v`; IQ4_XS beside Q5_K), held as one packed weight per run of parts of one
format instead of all at the widest part's width (1.55x the parts' bytes for Q4_K_M's QKV,
1.9x for IQ4 beside Q5_K: int8).

The format name lists each part's format in row order, joined by `+` (`int4-g32+int4-g32+
int6-g16`); adjacent parts of one format share one packed weight. Each run is a `Linear` of its
own format's method (`layer.parts`, not registered as submodules: they are processed here,
once); the layer's product is theirs side by side, and the fused decoder stack multiplies each
run into its columns (`native_linear` returns the list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tokenmill.layers.linear import Linear, LinearMethod
from tokenmill.quantization.weight_format import WeightFormat

SEPARATOR = "+"


def mixed_format_name(part_formats: list[str]) -> str:
    """The format of a fused layer whose parts are in `part_formats` (row order): the one
    format where they agree, else the mixed name."""
    if len(set(part_formats)) == 1:
        return part_formats[0]
    return SEPARATOR.join(part_formats)


class MixedPartsMethod(LinearMethod):
    """Loads the parts as they come (each its own format's checkpoint form), then makes one
    `Linear` per run of adjacent parts of one format."""

    holds_float_weight = False

    def __init__(
        self,
        part_formats: list[str],
        dequantize_on: torch.device | None,
        find_format: Callable[[str], WeightFormat | None],
    ) -> None:
        self.part_formats = part_formats
        self.dequantize_on = dequantize_on
        self.find_format = find_format
        self.weight_format = SEPARATOR.join(part_formats)

    def create_weights(self, layer: Linear, weight: torch.nn.Parameter | None) -> None:
        layer.loaded_parts = {}  # row_start -> the checkpoint's part, until processed
        layer.parts = []

    def load_weight(self, layer: Linear, loaded: object, row_start: int) -> None:
        layer.loaded_parts[row_start] = loaded

    def process_weights_after_loading(self, layer: Linear) -> None:
        starts = sorted(layer.loaded_parts)
        if len(starts) != len(self.part_formats):
            raise ValueError(
                f"a {self.weight_format} linear got {len(starts)} parts, not "
                f"{len(self.part_formats)}"
            )
        runs: list[tuple[str, list[int]]] = []
        for fmt, start in zip(self.part_formats, starts, strict=True):
            if runs and runs[-1][0] == fmt:
                runs[-1][1].append(start)
            else:
                runs.append((fmt, [start]))
        for fmt, run_starts in runs:
            pieces = [layer.loaded_parts[start] for start in run_starts]
            rows = sum(_rows(piece) for piece in pieces)
            part = Linear(layer.in_features, rows, self._method(fmt), dtype=layer.dtype)
            offset = 0
            for piece in pieces:
                part.quant_method.load_weight(part, piece, offset)
                offset += _rows(piece)
            part.quant_method.process_weights_after_loading(part)
            layer.parts.append(part)
        if sum(part.out_features for part in layer.parts) != layer.out_features:
            raise ValueError(f"a {self.weight_format} linear's parts do not cover its rows")
        del layer.loaded_parts

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in layer.parts], dim=-1)
        return out if layer.bias is None else out + layer.bias

    def apply_float32(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part.forward_float32(x) for part in layer.parts], dim=-1)
        return out if layer.bias is None else out + layer.bias

    def native_linear(self, layer: Linear) -> Any | None:
        parts = [part.quant_method.native_linear(part) for part in layer.parts]
        return None if any(part is None for part in parts) else parts

    def _method(self, fmt: str) -> LinearMethod:
        found = self.find_format(fmt)
        if found is None:
            raise ValueError(f"unknown weight format {fmt!r} of a fused layer's part")
        return found.method(fmt, self.dequantize_on)


def _rows(piece: object) -> int:
    return int(piece.shape[0])  # type: ignore[attr-defined]


class MixedPartsFormat(WeightFormat):
    """Fused layers whose parts' formats differ (`int4-g32+int4-g32+int6-g16`). `find_format`:
    the registry's lookup of a part's format (selection.py, which registers this one)."""

    family = "mixed"

    def __init__(self, find_format: Callable[[str], WeightFormat | None]) -> None:
        self.find_format = find_format

    def owns(self, name: str) -> bool:
        return SEPARATOR in name

    def kernel_available(self) -> bool:
        return True  # each part's format is checked when its method is made

    def method(self, name: str, dequantize_on: torch.device | None) -> LinearMethod:
        return MixedPartsMethod(name.split(SEPARATOR), dequantize_on, self.find_format)

    def embedding_lookup(self) -> bool:
        return False
