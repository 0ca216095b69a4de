"""Pre-quantized Hugging Face checkpoints, detected from config.json's `quantization_config`
as vLLM detects them: compressed-tensors (LLM Compressor's `int-quantized` W8A8 and
`pack-quantized` W4A16), GPTQ and AWQ 4-bit. Each linear's tensors are gathered into the
engine's own int8 (`Int8GroupWeight`) or int4 (`Int4GroupWeight`) form, no floats between.

On-disk conventions (compressed-tensors' `pack_to_int32`, whose `unpack_from_int32` reads
them here; AutoGPTQ's and AutoAWQ's packers, read by `_unpack_rows`):
- compressed-tensors int8: `weight` int8 `[out, in]`, `weight_scale` `[out, 1]`; w = q * s.
- compressed-tensors pack-quantized: `weight_packed` int32 `[out, in / 8]`, eight values per
  int32 along the input, the first in the low bits, each stored as q + 8; `weight_scale`
  `[out, in / group]`; asymmetric adds `weight_zero_point` packed the same way along the
  output dimension; w = (q - zp) * s.
- GPTQ: `qweight` int32 `[in / 8, out]` packed along the input, `qzeros` int32
  `[in / group, out / 8]` packed along the output, `scales` `[in / group, out]`; zeros are
  stored minus one (AutoGPTQ's format v1); w = (q - (z + 1)) * s.
- AWQ (GEMM): `qweight` int32 `[in, out / 8]` and `qzeros` `[in / group, out / 8]` packed
  along the output in the order 0, 2, 4, 6, 1, 3, 5, 7; `scales` `[in / group, out]`;
  w = (q - z) * s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.config import ConfigError
from tokenmill.quantization.int4 import INT4_GROUP_SIZES, Int4GroupWeight
from tokenmill.quantization.int8 import Int8GroupWeight

# (name, reader of that tensor) as the safetensors loader yields them.
Tensors = Iterator[tuple[str, Callable[[Any], Any]]]
_AWQ_UNPACK_ORDER = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
_COMPONENTS = {
    "compressed-tensors": ("weight", "weight_packed", "weight_scale", "weight_zero_point"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}
_IGNORED_COMPONENTS = ("weight_shape", "weight_g_idx", "input_scale", "input_zero_point")


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A checkpoint's scheme: `method` (compressed-tensors, gptq, awq), the weight format of
    its linears (int8, or int4-g<group>), and for compressed-tensors whether packed."""

    method: str
    weight_format: str
    symmetric: bool = True
    packed: bool = False

    def gather(self, tensors: Tensors) -> Tensors:
        """The checkpoint's tensors with each quantized linear's components (qweight,
        scales, ...) gathered into one `<module>.weight` in the engine's form."""
        components = _COMPONENTS[self.method]
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for name, read in tensors:
            module, _, leaf = name.rpartition(".")
            if leaf in _IGNORED_COMPONENTS:
                continue
            is_float_weight = leaf == "weight" and self.method == "compressed-tensors"
            if leaf in components and not (is_float_weight and _is_float(read)):
                groups.setdefault(module, {})[leaf] = _read_whole(read)
            else:
                yield name, read
        for module, parts in groups.items():
            weight = self._weight(module, parts)
            yield f"{module}.weight", lambda part, weight=weight: _whole(weight, part)

    def _weight(self, module: str, parts: dict[str, torch.Tensor]) -> object:
        try:
            if self.method == "compressed-tensors":
                return self._compressed_tensors(parts)
            if self.method == "gptq":
                return _gptq(parts, self._group_size())
            return _awq(parts, self._group_size())
        except (KeyError, RuntimeError, ValueError) as e:
            raise ConfigError(
                f"the {self.method} tensors of {module} do not fit its quantization_config: {e}"
            ) from e

    def _group_size(self) -> int:
        return int(self.weight_format.removeprefix("int4-g"))

    def _compressed_tensors(self, parts: dict[str, torch.Tensor]) -> object:
        scales = parts["weight_scale"].float()
        if not self.packed:
            values = parts["weight"]
            if "weight_zero_point" in parts and parts["weight_zero_point"].any():
                raise ValueError("asymmetric int8 weights are not supported")
            return Int8GroupWeight(values, scales.reshape(-1, 1))
        # Imported here: the package takes seconds to import, and only these checkpoints need it.
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        packed = parts["weight_packed"]
        cols = int(parts["weight_shape"][1]) if "weight_shape" in parts else 8 * packed.shape[1]
        codes = unpack_from_int32(packed, 4, torch.Size([packed.shape[0], cols]))  # -8..7
        values = (codes.to(torch.int16) + 8).to(torch.uint8)
        zeros = torch.zeros_like(scales)
        if "weight_zero_point" in parts:
            stored = parts["weight_zero_point"]  # packed along the rows
            shape = torch.Size([8 * stored.shape[0], stored.shape[1]])
            zero_points = unpack_from_int32(stored, 4, shape, packed_dim=0)[: scales.shape[0]]
            zeros = -zero_points.float() * scales
        return Int4GroupWeight(values, scales, zeros)


def _is_float(read: Callable[[Any], Any]) -> bool:
    return read(None).is_floating_point()


def _read_whole(read: Callable[[Any], Any]) -> torch.Tensor:
    return read(None)


def _whole(weight: object, part: Any) -> object:
    if part is not None:
        raise ConfigError("pre-quantized checkpoints load on one rank: use tensor_parallel_size 1")
    return weight


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[rows, cols / 8]` -> uint8 `[rows, cols]`, eight nibbles per int32 along a row,
    the first in the low bits."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.to(torch.int32)[..., None] >> shifts) & 0xF
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def _gptq(parts: dict[str, torch.Tensor], group_size: int) -> Int4GroupWeight:
    values = _unpack_rows(parts["qweight"].t().contiguous())  # [out, in]
    scales = parts["scales"].float().t().contiguous()  # [out, in / group]
    zeros_stored = _unpack_rows(parts["qzeros"]).t()[: scales.shape[0]]  # [out, in / group]
    if "g_idx" in parts:
        in_features = values.shape[1]
        trivial = torch.arange(in_features, dtype=torch.int32) // group_size
        if not torch.equal(parts["g_idx"].to(torch.int32), trivial):
            raise ValueError("desc_act (reordered groups, g_idx) is not supported")
    zeros = (8 - (zeros_stored.float() + 1)) * scales
    return Int4GroupWeight(values, scales, zeros)


def _awq(parts: dict[str, torch.Tensor], group_size: int) -> Int4GroupWeight:
    def unpack(packed: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] -> [rows, out]
        nibbles = _unpack_rows(packed).view(packed.shape[0], -1, 8)
        return nibbles[..., _AWQ_UNPACK_ORDER].reshape(packed.shape[0], -1)

    values = unpack(parts["qweight"]).t().contiguous()
    scales = parts["scales"].float().t().contiguous()
    zeros = (8 - unpack(parts["qzeros"]).t().float()) * scales
    return Int4GroupWeight(values, scales, zeros.contiguous())


def detect(hf_config: Any) -> QuantizedCheckpoint | None:
    """The checkpoint's scheme from its `quantization_config`, or None for a float one."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict()
    method = config.get("quant_method")
    architectures = getattr(hf_config, "architectures", None) or []
    if method == "mxfp4" and "GptOssForCausalLM" in architectures:
        return None  # only gpt-oss's experts, which its family holds as they are (mxfp4.py)
    if method == "compressed-tensors":
        return _detect_compressed_tensors(config)
    if method in ("gptq", "awq"):
        bits, group = config.get("bits", config.get("w_bit")), config.get("group_size")
        group = group if group is not None else config.get("q_group_size")
        if bits != 4 or group not in INT4_GROUP_SIZES:
            raise ConfigError(
                f"{method} with bits={bits}, group_size={group} is not supported: 4 bits in "
                f"groups of {', '.join(map(str, INT4_GROUP_SIZES))}"
            )
        if method == "gptq" and config.get("desc_act"):
            raise ConfigError("GPTQ with desc_act (reordered groups) is not supported")
        if method == "awq" and config.get("version", "gemm").lower() != "gemm":
            raise ConfigError(f"AWQ version {config.get('version')!r}: only GEMM is supported")
        return QuantizedCheckpoint(method, f"int4-g{group}")
    raise ConfigError(
        f"unknown quantization type {method!r} in config.json's quantization_config; "
        "tokenmill reads compressed-tensors, gptq, awq, mxfp4 (gpt-oss experts) and GGUF files"
    )


def _detect_compressed_tensors(config: dict) -> QuantizedCheckpoint:
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1 or not groups[0].get("weights"):
        raise ConfigError("compressed-tensors: exactly one config group with weights supported")
    weights = groups[0]["weights"]
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    symmetric = bool(weights.get("symmetric", True))
    fmt = config.get("format")
    if fmt == "int-quantized" and bits == 8 and strategy == "channel" and symmetric:
        return QuantizedCheckpoint("compressed-tensors", "int8")
    group = weights.get("group_size")
    if fmt == "pack-quantized" and bits == 4 and strategy == "group" and group in INT4_GROUP_SIZES:
        return QuantizedCheckpoint("compressed-tensors", f"int4-g{group}", symmetric, packed=True)
    raise ConfigError(
        f"compressed-tensors format {fmt!r} with {bits}-bit {strategy} weights "
        f"(symmetric={symmetric}, group_size={group}) is not supported: int-quantized 8-bit "
        "channel (W8A8) or pack-quantized 4-bit group (W4A16)"
    )
