"""gpt-oss GGUF files (`general.architecture` `gpt-oss`, as llama.cpp's converter writes them):
the config from the metadata and the experts back in the layout `GptOssExperts` loads
(models/gpt_oss_moe.py).

The converter splits each layer's interleaved gate/up product (gate the even rows, up the odd)
into `ffn_gate_exps` and `ffn_up_exps` (weights `[experts, rows, in]` and biases), keeps
`ffn_down_exps`, names the router `ffn_gate_inp` (with a bias) and the sinks `attn_sinks`.
MXFP4 experts are stored as ggml's MXFP4 blocks: per 32 values one E8M0 scale byte, then 16
bytes whose low nibbles are values 0-15 and high nibbles 16-31 (transformers' blocks pair
neighbours instead: value 2j low, 2j + 1 high). A file whose every expert tensor is MXFP4 keeps
them at 4 bits (rearranged into transformers' blocks and scales, exactly); experts of any
other type are read as floats. llama.cpp's gpt-oss graph fixes the SwiGLU's alpha (1.702) and
limit (7.0), alternates sliding-window and full layers from layer 0, and its YaRN is
gpt-oss's (beta 32 / 1, not truncated).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tokenmill.quantization.gguf_blocks import dequantize
from tokenmill.quantization.gguf_sizes import sized_fields
from tokenmill.quantization.mxfp4 import BLOCK

ARCHITECTURE = "gpt-oss"
HF_ARCHITECTURE = "GptOssForCausalLM"
# Block tensors -> Hugging Face module names, where not llama's (gguf_file.py).
NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_MXFP4 = GGMLQuantizationType.MXFP4
_MXFP4_BYTES = 1 + BLOCK // 2  # a scale, then 32 nibbles


def is_expert_tensor(name: str) -> bool:
    """Whether `name` is one of the experts' tensors `expert_tensors` reads (weights, biases)."""
    return any(f".{part}." in name for part in _EXPERTS)


def hf_name(name: str) -> str:
    """The sinks are a parameter of their own (`self_attn.sinks`), not a module's weight."""
    return name.removesuffix(".weight") if name.endswith(".self_attn.sinks.weight") else name


def all_mxfp4(tensors: Mapping[str, Any]) -> bool:
    experts = [t for name, t in tensors.items() if is_expert_tensor(name) and "weight" in name]
    return bool(experts) and all(t.tensor_type == _MXFP4 for t in experts)


def hf_config(
    sizes: Mapping[str, int],
    meta: Callable[..., Any],
    tied: bool,
    token_ids: Mapping[str, Any],
    mxfp4: bool,
) -> Any:
    """A transformers GptOssConfig from the metadata (`meta(key, default)` reads
    `gpt-oss.<key>`) and the checked sizes; MXFP4 experts as an `mxfp4` quantization config."""
    from transformers import GptOssConfig

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base"))}
    if meta("rope.scaling.type", "none") == "yarn":
        rope.update(
            rope_type="yarn",
            factor=float(meta("rope.scaling.factor")),
            original_max_position_embeddings=int(meta("rope.scaling.original_context_length")),
            beta_fast=float(meta("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(meta("rope.scaling.yarn_beta_slow", 1.0)),
            truncate=False,
        )
    layers = sizes["num_layers"]
    config = GptOssConfig(
        **{
            **sized_fields(sizes, meta),
            "intermediate_size": int(meta("expert_feed_forward_length")),
            "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        },
        sliding_window=int(meta("attention.sliding_window")),
        layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(layers)],
        rope_parameters=rope,
        num_local_experts=int(meta("expert_count")),
        num_experts_per_tok=int(meta("expert_used_count")),
        tie_word_embeddings=tied,
        **token_ids,
    )
    if mxfp4:
        config.quantization_config = {"quant_method": "mxfp4"}
    config.architectures = [HF_ARCHITECTURE]
    return config


def expert_tensors(
    tensors: Mapping[str, Any], num_layers: int, mxfp4: bool
) -> Iterator[tuple[str, Callable[[Any], torch.Tensor]]]:
    """Each layer's experts as `GptOssExperts` names them (`model.layers.{i}.mlp.experts.`
    `gate_up_proj[_blocks, _scales]`, `down_proj...`, `..._bias`): gate/up interleaved back."""
    for layer in range(num_layers):
        prefix, hf = f"blk.{layer}.", f"model.layers.{layer}.mlp.experts."
        gate, up, down = (tensors[f"{prefix}{part}.weight"] for part in _EXPERTS)
        gate_bias, up_bias, down_bias = (tensors[f"{prefix}{part}.bias"] for part in _EXPERTS)
        yield hf + "gate_up_proj_bias", _read(lambda g=gate_bias, u=up_bias: _pair(g, u, _floats))
        yield hf + "down_proj_bias", _read(lambda d=down_bias: _floats(d))
        if not mxfp4:
            yield hf + "gate_up_proj", _read(lambda g=gate, u=up: _pair(g, u, _floats))
            yield hf + "down_proj", _read(lambda d=down: _floats(d))
            continue
        for kind, index in (("blocks", 0), ("scales", 1)):
            yield (
                f"{hf}gate_up_proj_{kind}",
                _read(lambda g=gate, u=up, i=index: _pair(g, u, lambda t: _mxfp4(t)[i])),
            )
            yield f"{hf}down_proj_{kind}", _read(lambda d=down, i=index: _mxfp4(d)[i])


def _read(read: Callable[[], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    def reader(part: Any) -> torch.Tensor:
        if part is not None:
            from tokenmill.config import ConfigError

            raise ConfigError("GGUF files load on one rank: use tensor_parallel_size 1")
        return read()

    return reader


def _pair(gate: Any, up: Any, read: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """gate's and up's rows (dimension 1) interleaved: gate_up[:, 2j] = gate[:, j]."""
    halves = read(gate), read(up)
    return torch.stack(halves, dim=2).flatten(1, 2)


def _shape(tensor: Any) -> list[int]:
    return [int(n) for n in reversed(tensor.shape)]  # GGML lists the fastest dimension first


def _floats(tensor: Any) -> torch.Tensor:
    """Any type's values as float32, in the tensor's shape (`[experts, rows, in]`, `[experts,
    rows]`): MXFP4 expanded exactly."""
    shape = _shape(tensor)
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype == _MXFP4:
        from tokenmill.quantization.mxfp4 import dequantize as expand

        return expand(*_mxfp4(tensor), torch.float32)
    data = np.asarray(tensor.data)
    return dequantize(data.reshape(int(np.prod(shape[:-1])), -1), qtype).reshape(shape)


def _mxfp4(tensor: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 `[experts, rows, in]` as transformers' (blocks `[experts, rows, in / 32,
    16]`, scales `[experts, rows, in / 32]`)."""
    experts, rows, cols = _shape(tensor)
    data = np.asarray(tensor.data).reshape(experts, rows, cols // BLOCK, _MXFP4_BYTES)
    packed = torch.from_numpy(data[..., 1:].copy())
    values = torch.cat((packed & 0x0F, packed >> 4), dim=-1)  # value order 0..31
    blocks = values[..., 0::2] | (values[..., 1::2] << 4)
    return blocks.contiguous(), torch.from_numpy(data[..., 0].copy())
