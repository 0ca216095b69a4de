"""A gpt-oss checkpoint with MXFP4 experts, as the released ones ship them, made from a float
one: each stacked expert weight quantized to `*_blocks` + `*_scales` (quantization/mxfp4.py)
and `quantization_config.quant_method` "mxfp4"; beside it the same model with those experts
dequantized back to float, for transformers to run as the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokenmill.quantization import mxfp4

_EXPERT_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def write_mxfp4_checkpoint(float_dir: Path, mxfp4_dir: Path, dequantized_dir: Path) -> None:
    """`mxfp4_dir`: float_dir's model with MXFP4 experts; `dequantized_dir`: those experts
    expanded to float32 again (the weights the MXFP4 model computes with)."""
    tensors = load_file(float_dir / "model.safetensors")
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not name.endswith(_EXPERT_WEIGHTS):
            quantized[name] = dequantized[name] = tensor
            continue
        # float checkpoints store [experts, in, out]; MXFP4 blocks are [experts, out, in / 32]
        blocks, scales = mxfp4.quantize(tensor.transpose(1, 2))
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        expanded = mxfp4.dequantize(blocks, scales, torch.float32)
        dequantized[name] = expanded.transpose(1, 2).contiguous().to(tensor.dtype)
    config = json.loads((float_dir / "config.json").read_text())
    for target, weights in ((mxfp4_dir, quantized), (dequantized_dir, dequantized)):
        shutil.copytree(float_dir, target, dirs_exist_ok=True)
        (target / "model.safetensors").unlink()
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (mxfp4_dir / "config.json").write_text(json.dumps(config, indent=2))
