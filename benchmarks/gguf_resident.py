"""The bytes a GGUF file's weights take once loaded, against the file's own.

    python -m benchmarks.gguf_resident FILE.gguf [FILE.gguf ...]

Per file: the bytes of its quantized tensors in the file (2-D tensors of a type other than
F32 / F16 / BF16), and the bytes the engine holds for the layers they load into (each
quantized linear's packed codes, scales and offsets; the LM head once where the embedding is
tied to it), with the ratio; and the same per GGML type for layers whose parts are all of one
type (a fused layer of mixed types is counted under "mixed").
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from gguf import GGMLQuantizationType

from tokenmill import LLM
from tokenmill.layers.linear import Linear
from tokenmill.quantization.gguf_file import GGUFCheckpoint, _layer_of

_FLOAT = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def file_bytes_by_layer(path: Path) -> dict[str, tuple[int, set[str]]]:
    """tokenmill layer name -> (bytes in the file, GGML type names) of its quantized parts."""
    layers: dict[str, tuple[int, set[str]]] = {}
    checkpoint = GGUFCheckpoint(path)
    for name, tensor in checkpoint.tensors.items():
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if qtype in _FLOAT or len(tensor.shape) < 2:
            continue
        layer = _layer_of(checkpoint._hf_name(name) or name)
        size, types = layers.get(layer, (0, set()))
        layers[layer] = (size + int(tensor.n_bytes), types | {qtype.name})
    return layers


def held_bytes(layer: Linear) -> int:
    parts = getattr(layer, "parts", None)  # a mixed layer's (quantization/mixed_parts.py)
    if parts:
        return sum(held_bytes(part) for part in parts)
    packed = getattr(layer, "packed", None)
    if packed is None:
        return sum(t.numel() * t.element_size() for t in layer.state_dict().values())
    parts = (packed.codes, packed.scales, packed.offsets, packed.super_scales)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def measure(path: Path) -> dict[str, tuple[int, int]]:
    """GGML type (or "mixed", "all") -> (file bytes, held bytes)."""
    llm = LLM(model=str(path), max_model_len=64)
    model = llm.engine.runner.model
    held = {
        name.removeprefix("model."): held_bytes(module)
        for name, module in model.named_modules()
        if isinstance(module, Linear)
    }
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for layer, (size, types) in file_bytes_by_layer(path).items():
        if layer == "embed_tokens" and "embed_tokens" not in held:
            if "lm_head" in held and "lm_head" not in file_bytes_by_layer(path):
                layer = "lm_head"  # tied: the embedding's table is the LM head
            else:
                continue
        key = types.pop() if len(types) == 1 else "mixed"
        for k in (key, "all"):
            totals[k][0] += size
            totals[k][1] += held.get(layer, 0)
    return {k: (v[0], v[1]) for k, v in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    print("| file | tensors of type | MB in file | MB held | held / file |\n|---|---|---|---|---|")
    for path in args.files:
        for key, (size, held) in sorted(measure(path).items()):
            ratio = held / size if size else float("nan")
            print(f"| {path.name} | {key} | {size / 1e6:.2f} | {held / 1e6:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
