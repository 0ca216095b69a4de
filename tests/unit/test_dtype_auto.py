"""`dtype auto` on the CPU: bandwidth-bound decoders take bfloat16 wherever the CPU multiplies
it natively; compute-bound encoders only where its products outpace float32's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.config import EngineConfig, cpu_dtype


@pytest.mark.parametrize(
    ("fast_half", "outpaces", "decoder", "encoder"),
    [
        (True, True, torch.bfloat16, torch.bfloat16),
        (True, False, torch.bfloat16, torch.float32),
        (False, False, torch.float32, torch.float32),
    ],
)
def test_a_float32_checkpoint_runs_in_bfloat16_only_where_it_pays(
    monkeypatch: pytest.MonkeyPatch,
    fast_half: bool,
    outpaces: bool,
    decoder: torch.dtype,
    encoder: torch.dtype,
) -> None:
    monkeypatch.setattr(cpu_dtype, "cpu_has_fast_half_matmul", lambda: fast_half)
    monkeypatch.setattr(cpu_dtype, "cpu_bf16_outpaces_f32", lambda: outpaces)
    config = EngineConfig(model="unused", device="cpu", dtype="auto")
    assert config.torch_dtype(torch.float32) == decoder
    assert config.torch_dtype(torch.float32, compute_bound=True) == encoder
    explicit = EngineConfig(model="unused", device="cpu", dtype="float32")
    assert explicit.torch_dtype(torch.float32, compute_bound=True) == torch.float32


def test_bf16_outpaces_f32_with_amx_or_on_amd() -> None:
    """Read from /proc/cpuinfo here, not from the function under test."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("reads the CPU's vendor and flags from Linux's /proc/cpuinfo")
    text = cpuinfo.read_text()
    expected = "amx_tile" in text.split() or "AuthenticAMD" in text
    assert cpu_dtype.cpu_bf16_outpaces_f32() == expected


@pytest.mark.parametrize(("native", "decoder"), [("1", torch.bfloat16), ("0", torch.float32)])
def test_a_bfloat16_decoder_keeps_its_bytes_under_the_native_kernels(
    monkeypatch: pytest.MonkeyPatch, native: str, decoder: torch.dtype
) -> None:
    """Without native bf16 arithmetic (AVX2) a bfloat16 checkpoint's decoder stays bfloat16
    while the native products run (half the bytes a batch-1 step reads); its encoder, and
    every model on the portable path, runs in float32; float16 checkpoints in float32."""
    monkeypatch.setattr(cpu_dtype, "cpu_has_fast_half_matmul", lambda: False)
    monkeypatch.setenv("TOKENMILL_NATIVE_KERNELS", native)
    config = EngineConfig(model="unused", device="cpu", dtype="auto")
    assert config.torch_dtype(torch.bfloat16) == decoder
    assert config.torch_dtype(torch.bfloat16, compute_bound=True) == torch.float32
    assert config.torch_dtype(torch.float16) == torch.float32
