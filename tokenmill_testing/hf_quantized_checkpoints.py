"""Pre-quantized Hugging Face checkpoints in the exact on-disk formats of compressed-tensors
(W8A8 int-quantized, W4A16 pack-quantized), AutoGPTQ and AutoAWQ, made from a random float
checkpoint by round-to-nearest; and beside each the float checkpoint of its dequantized
weights, the reference a quantized engine should compute (see `quantization/hf_quantized.py`
for the conventions)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from safetensors.torch import load_file, save_file

from tokenmill_testing.quantized_checkpoints import DECODER_LINEAR, copy_checkpoint_files

SCHEMES = ("ct-w8a8", "ct-w4a16", "ct-w4a16-asym", "gptq", "awq")
_AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_rows(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """uint values `[rows, cols]` (0..15) -> int32 `[rows, cols / 8]`; nibble i of each int32
    holds column 8j + order[i]."""
    grouped = values.to(torch.int64).view(values.shape[0], -1, 8)[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return (grouped << shifts).sum(dim=-1)


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def _groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    return weight.view(weight.shape[0], -1, group)


def _symmetric_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q in -8..7 (as signed) and scales `[out, in / group]` (fp16-rounded)."""
    grouped = _groups(weight, group)
    scales = (grouped.abs().amax(dim=-1) / 7).clamp(min=1e-6).half().float()
    q = (grouped / scales[..., None]).round().clamp(-8, 7)
    return q.view(weight.shape).to(torch.int64), scales


def _asymmetric_int4(weight: torch.Tensor, group: int, min_zero: int = 0):
    """q in 0..15, integer zero points z in min_zero..15, scales; w ~ (q - z) * s."""
    grouped = _groups(weight, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-6).half().float()
    zeros = (-low / scales).round().clamp(min_zero, 15)
    q = (grouped / scales[..., None] + zeros[..., None]).round().clamp(0, 15)
    return q.view(weight.shape).to(torch.int64), zeros.to(torch.int64), scales


def _expand(groups: torch.Tensor, group: int) -> torch.Tensor:
    return groups.repeat_interleave(group, dim=1)


def quantize_module(weight: torch.Tensor, scheme: str, group: int):
    """(tensors to save under the module's prefix, the dequantized float weight)."""
    if scheme == "ct-w8a8":
        scales = (weight.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-8).half().float()
        q = (weight / scales).round().clamp(-127, 127).to(torch.int8)
        # Symmetric: compressed-tensors writes no zero point (vLLM refuses one).
        return {"weight": q, "weight_scale": scales.half()}, q.float() * scales
    if scheme == "ct-w4a16":
        q, scales = _symmetric_int4(weight, group)
        packed = pack_to_int32(q.to(torch.int8), 4)  # compressed-tensors' own writer
        shape = torch.tensor(weight.shape, dtype=torch.int32)
        saved = {"weight_packed": packed, "weight_scale": scales.half(), "weight_shape": shape}
        return saved, q.float() * _expand(scales, group)
    if scheme == "ct-w4a16-asym":
        q, zeros, scales = _asymmetric_int4(weight, group)
        signed_zero = zeros - 8  # compressed-tensors' zero points are signed, packed as z + 8
        saved = {  # compressed-tensors' own writer: signed values, zero points along the rows
            "weight_packed": pack_to_int32((q - 8).to(torch.int8), 4),
            "weight_scale": scales.half(),
            "weight_zero_point": pack_to_int32(signed_zero.to(torch.int8), 4, packed_dim=0),
            "weight_shape": torch.tensor(weight.shape, dtype=torch.int32),
        }
        return saved, (q - _expand(zeros, group)).float() * _expand(scales, group)
    # GPTQ stores zeros minus one in a nibble: a zero of 0 cannot be written.
    q, zeros, scales = _asymmetric_int4(weight, group, min_zero=1 if scheme == "gptq" else 0)
    dequantized = (q - _expand(zeros, group)).float() * _expand(scales, group)
    if scheme == "gptq":
        saved = {
            "qweight": _to_int32(_pack_rows(q.contiguous())).t().contiguous(),
            "qzeros": _to_int32(_pack_rows((zeros - 1).t().contiguous())),
            "scales": scales.t().contiguous().half(),
            "g_idx": torch.arange(weight.shape[1], dtype=torch.int32) // group,
        }
        return saved, dequantized
    if scheme == "awq":
        saved = {
            "qweight": _to_int32(_pack_rows(q.t().contiguous(), _AWQ_PACK_ORDER)),
            "qzeros": _to_int32(_pack_rows(zeros.t().contiguous(), _AWQ_PACK_ORDER)),
            "scales": scales.t().contiguous().half(),
        }
        return saved, dequantized
    raise ValueError(f"unknown scheme {scheme!r}; one of {SCHEMES}")


def quantization_config(scheme: str, group: int) -> dict:
    if scheme.startswith("ct-"):
        int8 = scheme == "ct-w8a8"
        weights = {
            "num_bits": 8 if int8 else 4,
            "type": "int",
            "symmetric": scheme != "ct-w4a16-asym",
            "strategy": "channel" if int8 else "group",
            "group_size": None if int8 else group,
        }
        activations = (
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
            if int8
            else None
        )
        return {
            "quant_method": "compressed-tensors",
            "format": "int-quantized" if int8 else "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": activations,
                }
            },
            "ignore": ["lm_head"],
        }
    if scheme == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": False,
            "checkpoint_format": "gptq",
        }
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }


def save_quantized_checkpoint(
    source: Path, destination: Path, reference: Path, scheme: str, group: int = 128
) -> tuple[Path, Path]:
    """`source` quantized by `scheme` into `destination`, and its dequantized float twin
    into `reference`."""
    copy_checkpoint_files(source, destination)
    copy_checkpoint_files(source, reference)
    config = json.loads((destination / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme, group)
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(file)
        quantized, dequantized = {}, dict(tensors)
        for name, tensor in tensors.items():
            if not DECODER_LINEAR.search(name):
                quantized[name] = tensor
                continue
            module = name.removesuffix(".weight")
            saved, float_weight = quantize_module(tensor.float(), scheme, group)
            quantized.update({f"{module}.{key}": value for key, value in saved.items()})
            dequantized[name] = float_weight.contiguous()
        save_file(quantized, destination / file.name, metadata={"format": "pt"})
        save_file(dequantized, reference / file.name, metadata={"format": "pt"})
    return destination, reference
