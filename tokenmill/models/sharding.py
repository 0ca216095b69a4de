"""Which slice of each checkpoint tensor a tensor-parallel rank loads (see layers/parallel.py).

A `RankSlice` is read straight from the safetensors file (`get_slice`), so a rank never
materialises the tensors, or the parts of them, it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.models.llama import LlamaForCausalLM

_COLUMN_PARALLEL = (".qkv_proj.", ".gate_up_proj.")  # split by output rows
_ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")  # split by input columns
_VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class RankSlice:
    dim: int
    start: int
    length: int


def fused_part_sizes(model: LlamaForCausalLM, target: str) -> list[int]:
    """Rows of each part (q, k, v or gate, up) of a fused parameter, on this rank."""
    shape, tp = model.shape, model.tp
    if ".qkv_proj." in target:
        q = tp.split(shape.num_heads, "number of attention heads") * shape.head_dim
        kv = model.num_local_kv_heads * shape.head_dim
        return [q, kv, kv]
    inter = tp.split(model.intermediate_size_of(target), "intermediate_size")
    return [inter, inter]


def rank_slice(model: LlamaForCausalLM, target: str, part: int | None) -> RankSlice | None:
    """The slice of checkpoint tensor `target` (part `part` of a fused one) this rank holds;
    None for a tensor every rank holds whole (norms, and any tensor when there is one rank)."""
    shape, tp = model.shape, model.tp
    if tp.size == 1:
        return None
    if any(key in target for key in _COLUMN_PARALLEL):
        assert part is not None
        size = fused_part_sizes(model, target)[part]
        if ".qkv_proj." in target and part > 0:
            return RankSlice(0, tp.kv_heads(shape.num_kv_heads)[1] * shape.head_dim, size)
        return RankSlice(0, tp.rank * size, size)
    if target.endswith(_ROW_PARALLEL):
        total = shape.num_heads * shape.head_dim if ".o_proj." in target else None
        size = tp.split(total or model.intermediate_size_of(target), "input size of " + target)
        return RankSlice(1, tp.rank * size, size)
    if target in _VOCAB_PARALLEL:
        start, per_rank = tp.vocab_range(shape.vocab_size)
        return RankSlice(0, start, max(0, min(per_rank, shape.vocab_size - start)))
    return None
