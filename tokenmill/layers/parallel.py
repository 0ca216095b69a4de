"""What a tensor-parallel rank holds of the model, and the two collectives its forward needs.

Megatron-style sharding: q/k/v and gate/up are split by output rows (column-parallel), o and
down by input columns (row-parallel, then one all-reduce), the vocabulary by rows (embedding:
masked lookup then all-reduce; LM head: all-gather of the logits). With one rank every
collective is the identity, so the single-process model is this code with `size=1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class GroupSlot:
    """A process group made only once the ranks have met (a pipeline stage's tensor-parallel
    group), while the model holding it is built before: read at each collective."""

    group: Any = None


def _resolved(group: Any) -> Any:
    return group.group if isinstance(group, GroupSlot) else group


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed process group or GroupSlot (None: the default)

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, intermediate rows), which must divide evenly."""
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size={self.size} does not divide the model's {what} ({total})"
            )
        return total // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(KV heads on this rank, the first one's index). With more ranks than KV heads each
        head is replicated on `size // num_kv_heads` consecutive ranks, as vLLM does."""
        if self.size <= num_kv_heads:
            local = self.split(num_kv_heads, "number of KV heads")
            return local, self.rank * local
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={self.size} is neither a divisor nor a multiple of the "
                f"model's number of KV heads ({num_kv_heads})"
            )
        return 1, self.rank * num_kv_heads // self.size

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """(first row, rows per rank) of the vocabulary; the last rank's tail is padding."""
        per_rank = -(-vocab_size // self.size)
        return self.rank * per_rank, per_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=_resolved(self.group))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=_resolved(self.group))
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose rows this rank holds `[start, start + per_rank)` of the vocabulary;
    a token outside them contributes zeros, and the all-reduce adds the owner's row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start, per_rank = tp.vocab_range(vocab_size)
        self.weight = torch.nn.Parameter(torch.empty(per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return torch.nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(hidden)
