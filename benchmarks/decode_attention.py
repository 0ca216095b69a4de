"""Where one layer's decode attention goes on the CPU: gather vs SDPA, and one alternative.

    OMP_NUM_THREADS=1 python benchmarks/decode_attention.py [--repeats 20]

SmolLM2-135M's attention shape (9 heads / 3 KV heads, head_dim 64, block 16, fp32), decode
groups of B sequences with contexts of different lengths (so the portable path needs a mask);
thread CPU time per call, medians of interleaved repeats:

- `portable`: `TorchPagedAttention` on the group (gather + SDPA with `enable_gqa`, bool mask);
- `gather`: its `read_kv` alone; `sdpa`: its SDPA alone, on the gathered K/V;
- `cpu`: `CpuPagedAttention` (the native kernel reading the blocks in place, issue #28);
- `folded`: the alternative tried for issue #13: the G query heads of a KV head folded into the
  query length (`[seqs, kv_heads, G, dim]`, no `enable_gqa`) and the mask as 0/-inf addends
  made once (SDPA converts a boolean mask on every call).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.layers.attention.base import AttentionGroup
from tokenmill.layers.attention.cpu_backend import CpuPagedAttention
from tokenmill.layers.attention.torch_backend import TorchPagedAttention
from tokenmill.layers.kv_cache import read_kv
from tokenmill.step.layout import layout_step

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def decode_group(seq_lens: list[int]) -> tuple[AttentionGroup, torch.Tensor, torch.Tensor]:
    """A decode group over a cache whose blocks are scattered at random, and its queries."""
    lens = np.array(seq_lens, dtype=np.int64)
    blocks = -(-lens // BLOCK)
    ids = np.random.default_rng(0).permutation(int(blocks.sum()))
    block_ids = np.split(ids, np.cumsum(blocks)[:-1])
    ones = np.ones_like(lens)
    _, metadata = layout_step(block_ids, ones, lens, BLOCK, None, torch.device("cpu"))
    cache = torch.randn(2, len(ids), BLOCK, KV_HEADS, DIM)
    return metadata.groups[0], cache, torch.randn(len(lens), HEADS, DIM)


def folded(query: torch.Tensor, cache: torch.Tensor, group: AttentionGroup, mask) -> torch.Tensor:
    keys, values = read_kv(cache, group.block_tables, query.dtype)
    keys, values = keys[:, :, : group.kv_len], values[:, :, : group.kv_len]
    q = query.view(query.shape[0], KV_HEADS, HEADS // KV_HEADS, DIM)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=DIM**-0.5)
    return out.reshape(query.shape)


def measure(seq_lens: list[int], repeats: int) -> dict[str, float]:
    """Median thread CPU seconds per call of each variant on one decode group."""
    group, cache, query = decode_group(seq_lens)
    batch, mask = len(seq_lens), group.mask
    additive = None if mask is None else torch.zeros(mask.shape).masked_fill_(~mask, -torch.inf)
    keys, values = read_kv(cache, group.block_tables, query.dtype)
    keys, values = keys[:, :, : group.kv_len], values[:, :, : group.kv_len]
    q = query.view(batch, 1, HEADS, DIM).transpose(1, 2)
    portable, out = TorchPagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5), torch.empty_like(query)

    native, native_out = CpuPagedAttention(HEADS, KV_HEADS, DIM, DIM**-0.5), torch.empty_like(query)

    def portable_call() -> torch.Tensor:
        portable._attend_group(query, cache, group, out)
        return out

    def native_call() -> torch.Tensor:
        native._attend_group(query, cache, group, native_out)
        return native_out

    calls: dict[str, Callable[[], object]] = {
        "portable": portable_call,
        "gather": lambda: read_kv(cache, group.block_tables, query.dtype),
        "sdpa": lambda: F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=DIM**-0.5, enable_gqa=True
        ),
        "folded": lambda: folded(query, cache, group, additive),
        "cpu": native_call,
    }
    torch.testing.assert_close(calls["folded"](), calls["portable"]())
    torch.testing.assert_close(calls["cpu"](), calls["portable"]())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.thread_time()
            call()
            times[name].append(time.thread_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    header = f"{'batch':>5} {'portable':>9} {'gather':>7} {'sdpa':>7} {'folded':>7} {'cpu':>7}"
    print(f"{header}  ms per layer")
    for batch in (1, 16, 64):
        ms = measure(rng.integers(130, 260, batch).tolist(), args.repeats)
        print(
            f"{batch:>5} {1e3 * ms['portable']:>9.3f} {1e3 * ms['gather']:>7.3f} "
            f"{1e3 * ms['sdpa']:>7.3f} {1e3 * ms['folded']:>7.3f} {1e3 * ms['cpu']:>7.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
