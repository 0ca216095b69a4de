"""A GGUF LoRA adapter (llama.cpp's `--lora` file, as its convert_lora_to_gguf.py writes one
from a peft adapter): `general.type` "adapter", `adapter.type` "lora", `adapter.lora.alpha`,
and per target `blk.N.<tensor>.weight.lora_a` (A `[r, in]`) and `.lora_b` (B `[out, r]`), in
any type the gguf package reads. Read into the same A/B pairs as a peft adapter.

As llama.cpp applies it: each pair scaled by `alpha / its rank` (1 when alpha is 0; peft's
rslora is not recorded in the file). llama.cpp's converter permuted the rows of q's and k's B
for its RoPE, as it does the base weights (Llama architecture): they are permuted back."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.config import ConfigError
from tokenmill.lora.peft_adapter import (
    BaseShapes,
    Halves,
    LoRAAdapterError,
    PeftAdapter,
    add_half,
    build_adapter,
    check_module,
)
from tokenmill.quantization.gguf_blocks import dequantize
from tokenmill.quantization.gguf_file import _unpermute_order
from tokenmill.quantization.gguf_moe import permutes_qk
from tokenmill.quantization.gguf_open import open_gguf

_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# llama.cpp's block tensor -> peft's module name.
_MODULES = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
# Tensors outside the blocks that an adapter may carry, by the peft module they stand for.
_OUTSIDE = {"token_embd": "embed_tokens", "output": "lm_head"}


def is_gguf_adapter(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def read_gguf_adapter(
    path: str | Path, name: str, lora_int_id: int, base: BaseShapes, max_lora_rank: int
) -> PeftAdapter:
    """Read and check the GGUF adapter at `path`; raises `LoRAAdapterError`."""
    try:
        reader = open_gguf(Path(path))
    except ConfigError as e:
        raise LoRAAdapterError(str(e)) from None
    meta = {key: _value(field) for key, field in reader.fields.items()}
    kinds = (meta.get("general.type"), meta.get("adapter.type"))
    if kinds != ("adapter", "lora"):
        raise LoRAAdapterError(
            f"{path} is no GGUF LoRA adapter: general.type {kinds[0]!r}, adapter.type "
            f"{kinds[1]!r} (llama.cpp's convert_lora_to_gguf.py writes 'adapter', 'lora')"
        )
    if meta.get("adapter.alora.invocation_tokens") is not None:
        raise LoRAAdapterError(f"adapter {name!r} is an activated LoRA (aLoRA): not supported")
    alpha = float(meta.get("adapter.lora.alpha") or 0.0)
    permuted = permutes_qk(str(meta.get("general.architecture", "")))
    halves: Halves = {}
    for tensor in reader.tensors:
        outside = _OUTSIDE.get(tensor.name.split(".")[0])
        if outside is not None:
            check_module(name, outside, base)  # raises: not supported
        match = _TENSOR.match(tensor.name)
        if match is None or match.group(2) not in _MODULES:
            raise LoRAAdapterError(
                f"adapter {name!r}: tensor {tensor.name!r} is no supported LoRA target "
                f"(blk.N.{{{','.join(_MODULES)}}}.weight.lora_a/lora_b)"
            )
        layer, module, half = int(match.group(1)), _MODULES[match.group(2)], match.group(3)
        weight = _read(tensor)
        if half == "b" and permuted and module in ("q_proj", "k_proj"):
            weight = _unpermute(weight, module, base)
        add_half(halves, name, base, layer, module, half.upper(), weight)
    return build_adapter(
        name, lora_int_id, halves, base, max_lora_rank, lambda rank: alpha / rank if alpha else 1.0
    )


def _value(field: Any) -> Any:
    try:
        return field.contents()
    except (ValueError, IndexError, TypeError):  # a layout the gguf package cannot decode
        return None


def _read(tensor: Any) -> torch.Tensor:
    """The tensor as float32, in torch's order (GGML lists the fastest dimension first)."""
    shape = [int(n) for n in reversed(tensor.shape)]
    data = np.asarray(tensor.data)
    return dequantize(data.reshape(shape[0], -1), tensor.tensor_type).reshape(shape)


def _unpermute(b: torch.Tensor, module: str, base: BaseShapes) -> torch.Tensor:
    """q's or k's B in Hugging Face's row order (a B of another shape is left for the shape
    check to name)."""
    heads = base.num_heads if module == "q_proj" else base.num_kv_heads
    if not heads or b.shape[0] != base.modules[module][1] or b.shape[0] % (2 * heads):
        return b
    return b[_unpermute_order(b.shape[0], heads)]
