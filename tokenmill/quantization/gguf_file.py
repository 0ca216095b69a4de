"""GGUF files (llama.cpp's format) as a checkpoint: the config from the metadata, and each
tensor under its Hugging Face name, in the form its linear layer's method takes.

llama.cpp's converter permutes the q and k rows of every head for its RoPE (pairs
interleaved; HF rotates halves): the rows are permuted back here, which is exact for
quantized tensors too (llama.cpp's blocks run along a row).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from tokenmill.config import ConfigError
from tokenmill.quantization import gguf_gemma3, gguf_gpt_oss, gguf_hybrid, gguf_phi3
from tokenmill.quantization.gguf_blocks import (
    CODE_BITS,
    GROUP_SIZE,
    INT4_TYPES,
    INT8_TYPES,
    IQ4_TYPES,
    dequantize,
    groups,
)
from tokenmill.quantization.gguf_moe import (
    EXPERT_TENSORS,
    MOE_BLOCK_NAMES,
    is_moe,
    moe_hf_config,
    moe_linear_names,
    permutes_qk,
)
from tokenmill.quantization.gguf_open import open_gguf
from tokenmill.quantization.gguf_sizes import sized_fields
from tokenmill.quantization.mixed_parts import mixed_format_name

logger = logging.getLogger(__name__)

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# general.architecture -> its block tensors' Hugging Face names, where not llama's.
_NAMES = {
    gguf_gemma3.ARCHITECTURE: gguf_gemma3.NAMES,
    gguf_gemma3.GEMMA2_ARCHITECTURE: gguf_gemma3.NAMES,
    gguf_phi3.ARCHITECTURE: gguf_phi3.NAMES,
    gguf_gpt_oss.ARCHITECTURE: gguf_gpt_oss.NAMES,
}
# The values that size the model: role (models/config_checks.py) -> metadata key after
# `<architecture>.`.
_SIZING_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_layers": "block_count",
    "num_heads": "attention.head_count",
    "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "vocab_size": "vocab_size",
    "max_position": "context_length",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# tokenmill's fused linears and the GGUF tensors each is made of.
_LINEAR_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


@dataclass
class GGUFCheckpoint:
    path: Path

    @cached_property
    def reader(self) -> GGUFReader:
        return open_gguf(self.path)

    def field(self, key: str, default: Any = None) -> Any:
        value = self.reader.fields.get(key)
        if value is None:
            return default
        contents = value.contents()
        return contents

    @cached_property
    def architecture(self) -> str:
        """`general.architecture`: the model registry (models/registry.py) says whether a
        family reads it; dense ones here, mixtures of experts in gguf_moe.py (llama.cpp
        writes Mixtral as `llama` with `llama.expert_count`)."""
        return str(self.field("general.architecture"))

    @cached_property
    def expert_count(self) -> int:
        """`<architecture>.expert_count`: 0 for a dense model."""
        return int(self.field(f"{self.architecture}.expert_count", 0) or 0)

    @cached_property
    def tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self.reader.tensors}

    def sizing_metadata(self) -> dict[str, tuple[str, Any]]:
        """What sizes the model, as `models/config_checks.py` checks it: role -> (metadata
        key, its value, None where absent)."""
        keys = {role: f"{self.architecture}.{key}" for role, key in _SIZING_KEYS.items()}
        return {role: (key, self.field(key)) for role, key in keys.items()}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's Hugging Face name (without `model.`) -> its shape, rows first (from
        the header: no data is read)."""
        return {
            hf_name.removeprefix("model."): tuple(int(n) for n in reversed(tensor.shape))
            for name, tensor in self.tensors.items()
            if (hf_name := self._hf_name(name)) is not None
        }

    def _hf_name(self, name: str) -> str | None:
        if self.architecture == gguf_hybrid.ARCHITECTURE and name.startswith("blk."):
            return gguf_hybrid.hf_name(name)
        hf_name = _hf_name(name, _NAMES.get(self.architecture, _GGUF_TO_HF))
        if hf_name is not None and self.architecture == gguf_gpt_oss.ARCHITECTURE:
            return gguf_gpt_oss.hf_name(hf_name)
        return hf_name

    def hf_config(self, sizes: Mapping[str, int]) -> Any:
        """A transformers LlamaConfig from the metadata, with the sizes `sizing_metadata`
        gave as `models/config_checks.py` checked them (role -> value, every role)."""
        from transformers import LlamaConfig

        arch = self.architecture

        def meta(key: str, default: Any = None) -> Any:
            value = self.field(f"{arch}.{key}", default)
            if value is None:
                raise ConfigError(f"{self.path} lacks the metadata key {arch}.{key}")
            return value

        token_ids = {
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
        }
        tied = "output.weight" not in self.tensors
        if arch == gguf_gpt_oss.ARCHITECTURE:  # its YaRN read there
            mxfp4 = gguf_gpt_oss.all_mxfp4(self.tensors)
            return gguf_gpt_oss.hf_config(sizes, meta, tied, token_ids, mxfp4)
        if self.field(f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or (
            "rope_freqs.weight" in self.tensors
        ):
            raise ConfigError(f"{self.path}: RoPE scaling in a GGUF file is not supported yet")
        if arch == gguf_gemma3.ARCHITECTURE:
            return gguf_gemma3.hf_config(sizes, meta, tied, token_ids)
        if arch == gguf_gemma3.GEMMA2_ARCHITECTURE:
            return gguf_gemma3.gemma2_hf_config(sizes, meta, tied, token_ids)
        if arch == gguf_phi3.ARCHITECTURE:
            return gguf_phi3.hf_config(sizes, meta, tied, token_ids, self._float_list)
        if arch == gguf_hybrid.ARCHITECTURE:
            return gguf_hybrid.hf_config(sizes, meta, tied, token_ids)
        common = dict(
            **sized_fields(sizes, meta),
            rope_parameters={"rope_type": "default", "rope_theta": meta("rope.freq_base", 1e4)},
            tie_word_embeddings=tied,
            **token_ids,
        )
        if is_moe(arch, self._meta):
            if "blk.0.ffn_gate_inp.weight" not in self.tensors:
                raise ConfigError(
                    f"{self.path}: {arch}.expert_count={self._meta('expert_count')} but no "
                    "router tensor (blk.0.ffn_gate_inp.weight): not a mixture-of-experts file "
                    "llama.cpp wrote"
                )
            return moe_hf_config(arch, meta, sizes, common, self.tensors.__contains__)
        config = LlamaConfig(**common)
        config.architectures = ["LlamaForCausalLM"]
        return config

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def linear_formats(self) -> dict[str, str]:
        """tokenmill's layer name -> the format its method takes (`_format_of`), for the
        decoder's linears, the LM head (`output.weight`, or the embedding's when tied) and the
        embedding (`embed_tokens`); types with no int8/int4 form are dequantized (logged)."""
        formats, dequantized = {}, []
        embedding = self._tensor("token_embd.weight").tensor_type
        output = self.tensors.get("output.weight")
        formats["embed_tokens"] = _format_of({embedding})
        formats["lm_head"] = _format_of({embedding if output is None else output.tensor_type})
        num_experts = self.expert_count
        for layer in range(self._num_blocks()):
            linears = {f"layers.{layer}.{name}": p for name, p in self._layer_parts(layer).items()}
            if num_experts and f"blk.{layer}.ffn_gate.weight" not in self.tensors:
                linears = {k: v for k, v in linears.items() if ".mlp." not in k}
                if self.architecture != gguf_gpt_oss.ARCHITECTURE:  # its experts: no Linears
                    linears.update(moe_linear_names(layer, num_experts, self.tensors.__contains__))
            for linear, parts in linears.items():
                part_types = [self._tensor(f"blk.{layer}.{p}.weight").tensor_type for p in parts]
                types = set(part_types)
                formats[linear] = fmt = _fused_format(part_types)
                if fmt != "float" and not self._columns_regroup(linear, types):
                    formats[linear] = fmt = "float"
                if fmt == "float" and not types <= set(_FLOAT_TYPES):
                    names = "/".join(parts)
                    dequantized.append(f"blk.{layer}.{names} ({'+'.join(t.name for t in types)})")
        if dequantized:
            logger.info(
                "dequantized to floats (no int8/int4 form for these types or mixes): %s",
                ", ".join(dequantized),
            )
        return formats

    def _layer_parts(self, layer: int) -> Mapping[str, tuple[str, ...]]:
        """Block `layer`'s linears (tokenmill's names after `layers.<i>.`) and their tensors."""
        if self.architecture == gguf_phi3.ARCHITECTURE:
            return gguf_phi3.LINEAR_PARTS
        if self.architecture != gguf_hybrid.ARCHITECTURE:
            return _LINEAR_PARTS
        return {  # a linear-attention layer's, or a full-attention one's
            linear: parts
            for linear, parts in gguf_hybrid.LINEAR_PARTS.items()
            if f"blk.{layer}.{parts[0]}.weight" in self.tensors
        }

    def _columns_regroup(self, linear: str, types: set[GGMLQuantizationType]) -> bool:
        """A Qwen3.5 `ssm_out` whose value heads split quantization groups is dequantized."""
        if not linear.endswith(".linear_attn.out_proj"):
            return True
        return gguf_hybrid.columns_regroup_whole(self._meta, min(GROUP_SIZE[t] for t in types))

    def iter_tensors(
        self, formats: dict[str, str], num_heads: int, num_kv_heads: int
    ) -> Iterator[tuple[str, Callable[[Any], object]]]:
        """(Hugging Face name, reader) per tensor; a reader takes the tensor-parallel slice,
        which must be None (GGUF files load on one rank)."""
        permuted = permutes_qk(self.architecture)
        if self.architecture == gguf_hybrid.ARCHITECTURE:
            yield from self._hybrid_tensors(formats)
            return
        gemma = self.architecture in gguf_gemma3.ARCHITECTURES
        gpt_oss = self.architecture == gguf_gpt_oss.ARCHITECTURE
        if gpt_oss:  # the experts, stacked as GptOssExperts holds them
            mxfp4 = gguf_gpt_oss.all_mxfp4(self.tensors)
            yield from gguf_gpt_oss.expert_tensors(self.tensors, self._num_blocks(), mxfp4)
        for name, tensor in self.tensors.items():
            if gpt_oss and gguf_gpt_oss.is_expert_tensor(name):
                continue
            hf_name = self._hf_name(name)
            if name in gguf_phi3.ROPE_FACTORS and self.architecture == gguf_phi3.ARCHITECTURE:
                continue  # read into the config
            if hf_name is None:
                raise ConfigError(f"unexpected tensor {name!r} in {self.path}")
            heads = num_heads if ".attn_q." in name else num_kv_heads if ".attn_k." in name else 0
            heads = heads if permuted else 0
            if ".mlp.experts." not in hf_name:
                quantized = formats.get(_layer_of(hf_name), "float") != "float"
                shift = gguf_gemma3.norm_shift(hf_name) if gemma else 0.0
                read = _reader(tensor, quantized, heads, shift)
                if hf_name.endswith(".shared_expert_gate.weight"):  # [1, hidden], stored 1-D
                    read = _as_row(read)
                yield hf_name, read
                continue
            for expert in range(int(tensor.shape[-1])):  # stacked: one tensor per expert
                expert_name = hf_name.replace(".mlp.experts.", f".mlp.experts.{expert}.")
                quantized = formats.get(_layer_of(expert_name), "float") != "float"
                yield expert_name, _reader(tensor, quantized, 0, expert=expert)

    def _hybrid_tensors(
        self, formats: dict[str, str]
    ) -> Iterator[tuple[str, Callable[[Any], object]]]:
        """A Qwen3.5 file's tensors as the checkpoint holds them (gguf_hybrid): quantized
        linears as their groups, the rest as floats."""
        for name, tensor in self.tensors.items():
            hf_name = self._hf_name(name)
            if hf_name is None:
                raise ConfigError(f"unexpected tensor {name!r} in {self.path}")
            quantized = formats.get(_layer_of(hf_name), "float") != "float"
            read = _reader(tensor, quantized, 0, gguf_hybrid.norm_shift(hf_name))
            yield hf_name, _restored(read, hf_name, self._meta)

    def _float_list(self, name: str) -> list[float] | None:
        """A small float tensor's values (LongRoPE's factors), None if the file has none."""
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        qtype = GGMLQuantizationType(tensor.tensor_type)
        return dequantize(np.asarray(tensor.data), qtype).reshape(-1).tolist()

    def _num_blocks(self) -> int:
        return int(self.field(f"{self.architecture}.block_count", 0))

    def _tensor(self, name: str) -> Any:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ConfigError(f"{self.path} lacks the tensor {name}")
        return tensor


def _format_of(types: set[GGMLQuantizationType]) -> str:
    """The layout that holds every part's blocks as they are, in groups of the smallest
    part's (a group of 32 is two of 16 with one scale): IQ4 indices alone (`iq4nl-g32`), else
    codes as wide as the widest part's (Q2_K: 2 bits, Q3_K: 3, Q4_0 / Q4_K: 4, Q5_0 / Q5_K:
    5, Q6_K: 6, Q8_0 and IQ4 values: 8), else floats."""
    if not types <= set(INT4_TYPES + INT8_TYPES):
        return "float"
    group = min(GROUP_SIZE[t] for t in types)
    if types <= set(IQ4_TYPES):
        return f"iq4nl-g{group}"
    return f"int{max(CODE_BITS[t] for t in types)}-g{group}"


def _fused_format(part_types: list[GGMLQuantizationType]) -> str:
    """A fused layer's format: each part held in its own type's (mixed_parts.py), floats if
    any part has no int8/int4 form."""
    part_formats = [_format_of({t}) for t in part_types]
    if "float" in part_formats:
        return "float"
    return mixed_format_name(part_formats)


def _hf_name(name: str, names: Mapping[str, str]) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    match = _BLOCK_NAME.match(name)
    if match is None:
        return None
    layer, module, suffix = match.groups()
    hf_module = names.get(module) or MOE_BLOCK_NAMES.get(module)
    if module in EXPERT_TENSORS:  # the experts' stack, without an expert's index
        hf_module = f"mlp.experts.{EXPERT_TENSORS[module]}"
    return None if hf_module is None else f"model.layers.{layer}.{hf_module}.{suffix}"


def _layer_of(hf_name: str) -> str:
    """model.layers.0.self_attn.q_proj.weight -> layers.0.self_attn.qkv_proj (and
    model.embed_tokens.weight -> embed_tokens)"""
    name = hf_name.removeprefix("model.").rsplit(".", 1)[0]
    for fused, old in (("qkv_proj", r"[qkv]_proj"), ("gate_up_proj", r"(gate|up)_proj")):
        name = re.sub(rf"\.{old}$", f".{fused}", name)
    return name


def _unpermute_order(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (HF row r = GGUF row order[r])."""
    return torch.arange(rows).view(num_heads, rows // num_heads // 2, 2).transpose(1, 2).flatten()


def _reader(
    tensor: Any,
    quantized: bool,
    num_heads: int,
    shift: float = 0.0,
    expert: int | None = None,
) -> Callable[[Any], object]:
    """Reads the tensor (or expert `expert`'s slice of a stack of experts); `shift`: what the
    converter added to a float tensor (Gemma's norms), taken off."""

    def read(part: Any) -> object:
        if part is not None:
            raise ConfigError("GGUF files load on one rank: use tensor_parallel_size 1")
        qtype = GGMLQuantizationType(tensor.tensor_type)
        data = np.asarray(tensor.data)
        shape = [int(n) for n in reversed(tensor.shape)]  # GGML lists the fastest dimension first
        if expert is not None:
            data, shape = data[expert], shape[1:]
        grouped = quantized and qtype in INT4_TYPES + INT8_TYPES
        if grouped:
            weight: Any = groups(data.reshape(shape[0], -1), qtype)
        elif len(shape) == 1:
            weight = dequantize(data, qtype).reshape(shape) - shift
        else:
            weight = dequantize(data.reshape(shape[0], -1), qtype)
        if num_heads and shape[0] % (2 * num_heads) == 0:  # else the loader names the shape
            order = _unpermute_order(shape[0], num_heads)
            weight = weight.permute_rows(order) if grouped else weight[order]
        return weight

    return read


def _as_row(read: Callable[[Any], object]) -> Callable[[Any], object]:
    return lambda part: torch.as_tensor(read(part)).reshape(1, -1)


def _restored(
    read: Callable[[Any], object], hf_name: str, meta: Callable[..., Any]
) -> Callable[[Any], object]:
    def restored(part: Any) -> object:
        weight = read(part)
        if isinstance(weight, torch.Tensor):
            return gguf_hybrid.restore(hf_name, weight, meta)
        return gguf_hybrid.restore_quantized(hf_name, weight, meta)  # a linear's groups

    return restored
