"""A quantized embedding: the lookup reads its rows out of a quantized linear's weight, the LM
head's when they are tied (one copy of the vocabulary's rows, as llama.cpp keeps one
`token_embd` for both), or its own otherwise.

The rows of a step's tokens are dequantized on the way out (a few rows per step: tokens x
hidden values), so the table stays int8 or int4 in memory. Where a model gets one:
`use_quantized_embedding` (quantization/selection.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.linear import Linear


class QuantizedEmbedding(nn.Module):
    """`embedding(input_ids)` from the rows of `table` (a quantized `Linear` whose weight is
    `[vocab, hidden]`), in `dtype`. A table that is the LM head is not registered as a
    submodule here (it is the model's `lm_head`); an own one is, as `table`."""

    def __init__(self, table: Linear, dtype: torch.dtype, shared: bool) -> None:
        super().__init__()
        self.dtype = dtype
        if shared:
            self._shared = [table]  # a plain list: not a second registration of the LM head
        else:
            self.table = table

    @property
    def weight_format(self) -> str:
        return self.rows_owner().quant_method.weight_format

    def rows_owner(self) -> Linear:
        return self._shared[0] if hasattr(self, "_shared") else self.table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        owner = self.rows_owner()
        rows = owner.quant_method.dequantize_rows(owner, input_ids.reshape(-1))
        return rows.to(self.dtype).view(*input_ids.shape, -1)
