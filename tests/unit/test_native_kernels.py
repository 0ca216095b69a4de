"""The native CPU kernels against their torch references, at every ISA level this CPU runs
(the AVX2 and portable paths through `set_isa`, as TOKENMILL_CPU_ISA does), and the fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import native
from tokenmill.kernels.attention import native_paged_attention
from tokenmill.kernels.linear import (
    native_dense_linear,
    pack_linear_weight,
    packed_linear,
    packed_linear_available,
    unpack_linear_weight,
)
from tokenmill.layers.attention.base import build_attention_group
from tokenmill.layers.attention.torch_backend import TorchPagedAttention
from tokenmill.layers.kv_cache import write_kv

module = native.native_kernels()
needs_native = pytest.mark.skipif(module is None, reason="native kernels not buildable here")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 16, 21, 37, 70])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (7, 33), (130, 64), (5, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(
    isa: int, dtype: torch.dtype, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    """Row counts around every kernel's tiles (four rows per weight load, AMX from five, 16-row
    tiles with tails); shapes off the 16-row blocks and 32-wide k steps."""
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    packed = pack_linear_weight(weight)
    assert torch.equal(unpack_linear_weight(packed, out_features, in_features), weight)
    got = packed_linear(x, packed, out_features, b)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
    scale = reference.abs().max().item()
    assert (got.float() - reference).abs().max().item() <= TOLERANCE[dtype] * scale


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [200, 109])
def test_a_rows_product_does_not_depend_on_the_other_rows(
    isa: int, dtype: torch.dtype, out_features: int
) -> None:
    """Below AMX (which tiles 16 rows its own way), every row count gives each row the bits it
    gets alone: a speculative verification of k + 1 rows must score its first token exactly
    as a one-token decode step would (greedy equality). 5 and 9 rows: the five-row pass
    (AVX2, AVX-512 BF16), 6-8: the six-row pass and its neighbours (AVX-512 BF16); 1, 2, 6
    and 10 rows: AVX2's last one or two rows over 4, 2 and single blocks a pass (13 and 7
    blocks of 16 columns, in chunks of 4)."""
    if isa >= native.ISA_LEVELS.index("amx"):
        pytest.skip("AMX's tiles round rows in groups")
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(out_features, 70, generator=generator).to(dtype)
    packed = pack_linear_weight(weight)
    x = torch.randn(13, 70, generator=generator).to(dtype)
    alone = torch.cat([packed_linear(x[i : i + 1], packed, out_features, None) for i in range(13)])
    reference = F.linear(x.float(), weight.float())
    scale = reference.abs().max().item()
    assert (alone.float() - reference).abs().max().item() <= TOLERANCE[dtype] * scale
    for rows in range(2, 14):
        got = packed_linear(x[:rows], packed, out_features, None)
        assert torch.equal(got, alone[:rows]), rows


@needs_native
def test_packed_linear_takes_any_leading_shape() -> None:
    weight = torch.randn(48, 40)
    x = torch.randn(2, 3, 40)
    got = packed_linear(x, pack_linear_weight(weight), 48, None)
    assert got.shape == (2, 3, 48)
    assert torch.allclose(got, F.linear(x, weight), atol=1e-5)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("float32_out", [False, True])
def test_a_dense_native_linear_runs_the_packed_product(
    dtype: torch.dtype, float32_out: bool
) -> None:
    """The native `PackedLinear` of a dense weight (what the fused stack takes) multiplies as
    `packed_linear` does: each format's factory gives it its product (csrc/linear.h)."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(40, 72, generator=generator).to(dtype)
    x = torch.randn(6, 72, generator=generator).to(dtype)
    bias = torch.randn(40, generator=generator)
    packed = pack_linear_weight(weight)
    linear = native_dense_linear(packed, 40, 72)
    got = linear.forward(x, bias, float32_out)
    assert got.dtype == (torch.float32 if float32_out else dtype)
    assert torch.equal(got, packed_linear(x, packed, 40, bias, float32=float32_out))


def _paged_case(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache filled at scattered blocks, the queries, and the block tables."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = order[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    for seq, length in enumerate(seq_lens):
        positions = torch.arange(length)
        slots = block_tables[seq, positions // block_size] * block_size + positions % block_size
        kv = torch.randn(length, 2, num_kv_heads, head_dim, generator=generator).to(dtype)
        write_kv(cache, slots, kv)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    return cache, query, block_tables


CASES = [
    # heads, kv heads, head_dim, block size, query lens, seq lens
    (9, 3, 64, 16, [1], [129]),  # SmolLM2's heads, a context just past a block
    (4, 4, 32, 16, [1, 1, 1], [1, 16, 17]),  # MHA, lengths at block edges
    (8, 2, 80, 4, [1, 1], [37, 5]),  # GQA 4, head size not a multiple of 16
    (6, 1, 24, 8, [3, 5], [20, 5]),  # MQA, verification rows (query_len > 1), tiny head
    (2, 2, 128, 32, [16, 1], [40, 70]),  # a short chunk beside a decode
    (9, 3, 64, 16, [1, 40, 9, 1], [300, 40, 60, 2]),  # prefill chunks across query tiles
    (16, 2, 64, 16, [17], [17]),  # GQA 8, a whole prompt at once
    # Tasks enough for every KV head of a sequence in one task (head size 128)
    (8, 2, 128, 16, [1] * 9, [5, 16, 17, 33, 64, 1, 2, 90, 31]),
]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sliding_window", [None, 7, 33])
def test_paged_attention_matches_the_torch_backend(
    isa: int, dtype: torch.dtype, case: tuple, sliding_window: int | None
) -> None:
    num_heads, num_kv_heads, head_dim, block_size, query_lens, seq_lens = case
    cache, query, block_tables = _paged_case(
        dtype, num_heads, num_kv_heads, head_dim, block_size, query_lens, seq_lens, seed=len(case)
    )
    group = build_attention_group(
        0,
        torch.tensor(query_lens),
        torch.tensor(seq_lens),
        block_tables,
        block_size,
        sliding_window,
    )
    scale = head_dim**-0.5
    reference = torch.empty_like(query)
    TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)._attend_group(
        query, cache, group, reference
    )
    got = torch.full_like(query, float("nan"))
    assert group.query_start_loc is not None and group.seq_lens is not None
    assert native_paged_attention(
        query,
        cache,
        group.block_tables,
        group.query_start_loc,
        group.seq_lens,
        sliding_window,
        scale,
        got,
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), reference.float(), atol=tolerance, rtol=tolerance)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5]], ids=["d24", "d64", "d128"])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("extra", ["sinks", "softcap"])
def test_paged_attention_sinks_and_softcap_match_the_torch_backend(
    isa: int, dtype: torch.dtype, case: tuple, sliding_window: int | None, extra: str
) -> None:
    """gpt-oss's attention sinks (a per-head logit in the softmax's denominator) and Gemma 2's
    score soft-capping in every kernel variant (the portable head loop, AVX-512 at head sizes
    64 and 128)."""
    num_heads, num_kv_heads, head_dim, block_size, query_lens, seq_lens = case
    cache, query, block_tables = _paged_case(
        dtype, num_heads, num_kv_heads, head_dim, block_size, query_lens, seq_lens, seed=3
    )
    group = build_attention_group(
        0, torch.tensor(query_lens), torch.tensor(seq_lens), block_tables, block_size,
        sliding_window,
    )  # fmt: skip
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(7)) * 2
    # Scores of a few units capped at 1.5: most of them well into tanh's bend.
    scale, softcap = (head_dim**-0.5, None) if extra == "sinks" else (head_dim**-0.25, 1.5)
    backend = TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    backend.sinks, backend.softcap = (sinks if extra == "sinks" else None), softcap
    reference, without = torch.empty_like(query), torch.empty_like(query)
    backend._attend_group(query, cache, group, reference)
    TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)._attend_group(
        query, cache, group, without
    )
    assert not torch.allclose(reference.float(), without.float(), atol=1e-2)  # they matter
    got = torch.full_like(query, float("nan"))
    assert group.query_start_loc is not None and group.seq_lens is not None
    assert native_paged_attention(
        query, cache, group.block_tables, group.query_start_loc, group.seq_lens,
        sliding_window, scale, got, backend.sinks, softcap,
    )  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), reference.float(), atol=tolerance, rtol=tolerance)


@needs_native
def test_paged_attention_reads_strided_queries() -> None:
    """Queries as the fused QKV projection leaves them: a view with a wider token stride."""
    cache, query, block_tables = _paged_case(torch.float32, 4, 2, 16, 4, [1, 1], [9, 3], seed=5)
    fused = torch.cat([query.flatten(1), torch.randn(2, 40)], dim=1)
    strided = fused[:, :64].view(2, 4, 16)
    group = build_attention_group(0, torch.ones(2), torch.tensor([9, 3]), block_tables, 4, None)
    expected, got = torch.empty_like(query), torch.empty_like(query)
    TorchPagedAttention(4, 2, 16, 0.25)._attend_group(query, cache, group, expected)
    assert native_paged_attention(
        strided, cache, block_tables, group.query_start_loc, group.seq_lens, None, 0.25, got
    )
    assert torch.allclose(got, expected, atol=1e-5)


def test_forced_fallback_has_no_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_NATIVE_KERNELS", "0")
    native.reset_for_tests()
    try:
        assert native.native_kernels() is None
        assert native.active_isa() is None
        assert not packed_linear_available(torch.float32, torch.device("cpu"))
    finally:
        monkeypatch.delenv("TOKENMILL_NATIVE_KERNELS")
        native.reset_for_tests()


def test_unbuildable_extension_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler() -> None:
        raise OSError("no C++ compiler")

    monkeypatch.delenv("TOKENMILL_NATIVE_KERNELS", raising=False)
    monkeypatch.setattr(native, "_build", no_compiler)
    native.reset_for_tests()
    try:
        with pytest.warns(RuntimeWarning, match="portable torch path"):
            assert native.native_kernels() is None
    finally:
        native.reset_for_tests()


def test_isa_override_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "avx2")
    assert native.requested_isa() == 1
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="TOKENMILL_CPU_ISA"):
        native.requested_isa()


@needs_native
@pytest.mark.parametrize("width", [1, 5, 16, 17, 1000, 49152])
def test_argmax_rows_matches_torch(isa: int, width: int) -> None:
    """Ties (rounded values) go to the first index, NaN counts as the maximum, -inf rows."""
    from tokenmill.kernels.argmax import argmax_rows

    generator = torch.Generator().manual_seed(width)
    for trial in range(8):
        x = torch.randn(7, width, generator=generator)
        if trial % 3 == 0:
            x = x.round()
        if trial == 4:
            x[2, width // 2] = float("nan")
        if trial == 5:
            x[:] = float("-inf")
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
