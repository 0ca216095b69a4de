"""EAGLE and Medusa heads on disk, in the formats vLLM loads for Llama targets.

EAGLE (vLLM's `EagleLlamaForCausalLM`): a Llama config.json with one hidden layer, and
`fc.weight` (`[H, 2H]`, over the concatenated token embedding and target hidden state),
optionally `fc.bias`, and the decoder layer's `layers.0.*` tensors (q/k/v/o, gate/up/down,
`post_attention_layernorm`; an `input_layernorm` is ignored: EAGLE's layer has none). The
token embedding and LM head are the target's (an `embed_tokens` or `lm_head` tensor in the
file is ignored). Names may carry a `model.` prefix.

Medusa (vLLM's `MedusaModel`): a config.json with `hidden_size`, `vocab_size`, `num_heads`,
`num_hidden_layers` (residual blocks per head), and `blocks.{i}.layers.{j}.weight/bias` and
`lm_heads.{i}.weight`; the original Medusa names (`medusa_heads.{i}.{j}.linear.*`, with the
LM head as the last entry `medusa_heads.{i}.{n}.weight`) are read too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tokenmill.config import ConfigError
from tokenmill.layers.linear import (
    DenseLinearMethod,
    OneDNNLinearMethod,
    PackedLinearMethod,
    onednn_linear_available,
    use_fast_cpu_linears,
)
from tokenmill.models.llama import LlamaForCausalLM, ModelShape
from tokenmill.quantization.int8 import int8_linear, int8_linear_available
from tokenmill.spec_decode.eagle import EagleDraft
from tokenmill.spec_decode.medusa import MedusaHeads
from tokenmill.spec_decode.mtp import MtpDraft

EAGLE_ARCHITECTURE = "EagleLlamaForCausalLM"
MEDUSA_ARCHITECTURE = "MedusaModel"
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_FUSED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_FUSE_ORDER = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _write(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor], info: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "tokenmill_demo.json").write_text(json.dumps(info, indent=2) + "\n")
    for path in out_dir.iterdir():
        path.chmod(0o644)


def save_eagle(state: dict[str, torch.Tensor], target_config: Any, out_dir: Path, info: dict):
    """An EAGLE directory: the target's Llama config with one layer, and the tensors of
    `state` (checkpoint names: fc.*, layers.0.*)."""
    config = target_config.to_dict()
    config.update(architectures=[EAGLE_ARCHITECTURE], num_hidden_layers=1, model_type="llama")
    _write(out_dir, config, state, info)


def save_medusa(state: dict[str, torch.Tensor], target_config: Any, out_dir: Path, info: dict):
    """A Medusa directory; tensors stored in bfloat16 (half the size, loaded as float32)."""
    num_heads = len({k.split(".")[1] for k in state})  # blocks.i / lm_heads.i / medusa_heads.i
    config = {
        "architectures": [MEDUSA_ARCHITECTURE],
        "model_type": "medusa",
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
        "num_heads": num_heads,
        "num_hidden_layers": 1,
        "medusa_fc_bias": True,
    }
    _write(out_dir, config, {k: v.to(torch.bfloat16) for k, v in state.items()}, info)


def _read(head_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    path = Path(head_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"speculative heads: no config.json in {path}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"speculative heads: no *.safetensors weights in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return json.loads(config_file.read_text()), tensors


def _check_target(kind: str, head_dir: str | Path, config: dict, target: LlamaForCausalLM):
    shape = target.shape
    for key, want in (("hidden_size", shape.hidden_size), ("vocab_size", shape.vocab_size)):
        have = config.get(key)
        if have is not None and have != want:
            raise ConfigError(
                f"the {kind} heads at {head_dir} were made for a target with {key}={have}; "
                f"this target has {key}={want}: heads only work on the model they were "
                "trained on"
            )


def load_checked_state(module: torch.nn.Module, state: dict[str, torch.Tensor], head_dir) -> None:
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"the heads at {head_dir} do not match their config: missing {missing}, "
            f"unexpected {unexpected}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ConfigError(
                f"the heads at {head_dir}: {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )
    module.load_state_dict(state)


def speed_up_draft(module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """The draft's linears in the target's CPU kernels (the native packed layout), in float32
    and bfloat16 alike: torch's own bfloat16 product of one row costs about a millisecond
    here, more than a whole decode step of the demo target."""
    module.eval().requires_grad_(False)
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        use_fast_cpu_linears(module)


def load_eagle(
    head_dir: str | Path,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    draft_weights: str = "full",
) -> EagleDraft:
    config, tensors = _read(head_dir)
    _check_target("EAGLE", head_dir, config, target)
    if config.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"the EAGLE heads at {head_dir}: only one decoder layer is supported")
    shape = ModelShape.from_hf_config(_Namespace({**_target_defaults(target), **config}))
    state = fused_state(
        (name, tensor)
        for name, tensor in ((n.removeprefix("model."), t) for n, t in tensors.items())
        if not name.startswith(("embed_tokens.", "lm_head.")) and ".input_layernorm." not in name
    )
    with torch.device(device):
        fc_width = state["fc.weight"].shape[1] if "fc.weight" in state else 0
        current_token = fc_width == 3 * shape.hidden_size  # see EagleDraft
        draft = EagleDraft(shape, target, "fc.bias" in state, current_token)
    load_checked_state(draft, {k: v.to(dtype) for k, v in state.items()}, head_dir)
    draft.to(device=device, dtype=dtype)
    if int8_drafts(draft_weights, dtype, device):
        quantize_draft(draft, target)
    speed_up_draft(draft, dtype, device)
    return draft


def fused_state(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A decoder layer's checkpoint tensors with q/k/v and gate/up concatenated, as
    tokenmill's layers hold them (`qkv_proj`, `gate_up_proj`)."""
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = re.search(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.", name)
        if match is None:
            state[name] = tensor
            continue
        fused = name.replace(f".{match.group(1)}.", f".{_FUSED[match.group(1)]}.")
        parts.setdefault(fused, {})[match.group(1)] = tensor
    for fused, pieces in parts.items():
        state[fused] = torch.cat([pieces[k] for k in _FUSE_ORDER if k in pieces])
    return state


def int8_drafts(draft_weights: str, dtype: torch.dtype, device: torch.device) -> bool:
    if draft_weights == "full":
        return False
    usable = device.type == "cpu" and dtype == torch.float32 and int8_linear_available()
    if draft_weights == "int8" and not usable:
        raise ConfigError(
            "speculative draft_weights 'int8' needs float32 on the CPU and torch's "
            "_weight_int8pack_mm kernel"
        )
    return usable


def quantize_draft(draft: EagleDraft | MtpDraft, target: LlamaForCausalLM) -> None:
    """The draft layer's linears and a copy of the target's LM head as weight-only int8: a
    draft at batch 1 streams every weight once per token (`quantization/int8.py`)."""
    fallback = OneDNNLinearMethod() if onednn_linear_available() else DenseLinearMethod()
    for parent in list(draft.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, int8_linear(child.weight, child.bias, fallback))
    weight = _lm_head_weight(target)
    if weight is not None and target.tp.size == 1:  # a sharded LM head stays the target's
        draft.draft_lm_head = int8_linear(weight[: target.shape.vocab_size], None)


def _lm_head_weight(target: LlamaForCausalLM) -> torch.Tensor | None:
    """The target's LM head weight, where it is still held in torch's layout (oneDNN's
    packed layout keeps it only for small weights) or tied to a float embedding (None for a
    quantized head: the draft uses the target's, already int8)."""
    weight = getattr(target.lm_head, "weight", None)
    if weight is None and target.shape.tie_word_embeddings:
        weight = getattr(target.embed_tokens, "weight", None)
    if weight is None and isinstance(target.lm_head.quant_method, PackedLinearMethod):
        weight = PackedLinearMethod.plain_weight(target.lm_head)
    return weight


def load_medusa(
    head_dir: str | Path, target: LlamaForCausalLM, dtype: torch.dtype, device: torch.device
) -> MedusaHeads:
    config, tensors = _read(head_dir)
    _check_target("Medusa", head_dir, config, target)
    state: dict[str, torch.Tensor] = {}
    num_layers = int(config.get("num_hidden_layers", 1))
    for name, tensor in tensors.items():
        match = re.fullmatch(r"medusa_heads\.(\d+)\.(\d+)\.(linear\.)?(weight|bias)", name)
        if match is not None:  # the original Medusa layout
            head, index, _, kind = match.groups()
            if int(index) == num_layers:
                name = f"lm_heads.{head}.{kind}"
            else:
                name = f"blocks.{head}.layers.{index}.{kind}"
        state[name] = tensor.to(dtype)
    num_heads = int(config.get("num_heads") or config.get("medusa_num_heads") or 0)
    with torch.device(device):
        heads = MedusaHeads(
            target.shape.hidden_size,
            target.shape.vocab_size,
            num_heads,
            num_layers,
            bias=any(k.endswith(".bias") for k in state),
        )
    load_checked_state(heads, state, head_dir)
    heads.to(device=device, dtype=dtype)
    heads.stack()
    return heads


def _target_defaults(target: LlamaForCausalLM) -> dict:
    """Config fields an EAGLE config may leave out: the target's."""
    shape = target.shape
    return {
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size,
        "rms_norm_eps": shape.rms_norm_eps,
        "max_position_embeddings": shape.max_position,
        "tie_word_embeddings": False,
    }


class _Namespace:
    """A config dict read as attributes (what `ModelShape.from_hf_config` takes)."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)
