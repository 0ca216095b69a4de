"""Reference checkpoints for quantization tests: a float checkpoint whose decoder linear
weights are replaced by their dequantized values, so that a float model (transformers', or
tokenmill's without quantization) computes what a quantized engine should."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# The decoder's linear weights, as Hugging Face checkpoints name them.
DECODER_LINEAR = re.compile(r"layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def copy_checkpoint_files(source: Path, destination: Path) -> None:
    """Everything but the weights: config, generation config, tokenizer files."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copyfile(path, destination / path.name)


def save_dequantized_checkpoint(
    source: Path, destination: Path, round_trip: Callable[[str, torch.Tensor], torch.Tensor]
) -> Path:
    """`source` with every decoder linear weight `w` (named `name`) replaced by
    `round_trip(name, w)` (quantize then dequantize), in float32."""
    copy_checkpoint_files(source, destination)
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            if DECODER_LINEAR.search(name):
                tensors[name] = round_trip(name, tensor.float()).contiguous()
        save_file(tensors, destination / file.name, metadata={"format": "pt"})
    return destination
