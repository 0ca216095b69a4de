"""What a weight format tells the plan that picks each layer's method (selection.py).

A format is one module of this package (`int8.py`, `int4.py`): its checkpoint form, its
`LinearMethod`, its packing for its kernel, and one `WeightFormat` registered in
`selection.WEIGHT_FORMATS`, the only list of formats. A format name is what the start-up log
and /v1/models report and a checkpoint reader declares per layer (`int8`, `int8-g32`,
`int4-g128`, ...); a format owns a family of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType

import torch

from tokenmill.layers.linear import LinearMethod


class WeightFormat(ABC):
    """One family of format names and how a layer of it is made."""

    # The family's name in messages ("int4": "int8 instead of int4 for ...").
    family: str
    # `--quantization` values this format serves -> the format name of the decoder's linears.
    online: Mapping[str, str] = MappingProxyType({})
    # The format a layer gets where `fits` says this one's kernel cannot take its shape.
    fallback: str | None = None

    @abstractmethod
    def owns(self, name: str) -> bool:
        """Whether `name` (e.g. "int4-g32") is one of this family's."""

    @abstractmethod
    def kernel_available(self) -> bool:
        """Whether a CPU kernel for it runs here (the native one, or torch's)."""

    @abstractmethod
    def method(self, name: str, dequantize_on: torch.device | None) -> LinearMethod:
        """The method of a layer in format `name`. `dequantize_on`: the device whose torch ops
        run the layer (off the CPU, or `--linear-backend torch`); None: the CPU's kernels."""

    def fits(
        self, name: str, out_features: int, in_features: int, dequantize_on: torch.device | None
    ) -> bool:
        """Whether the kernel of format `name` takes a weight of this shape (else the layer
        gets `fallback`)."""
        return True

    def embedding_lookup(self) -> bool:
        """Whether an embedding can look its rows up in a table of this format here (CPU)."""
        return True
