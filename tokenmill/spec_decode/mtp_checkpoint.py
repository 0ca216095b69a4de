"""A checkpoint's MTP layer read as a draft (`{"method": "mtp"}`; layouts in `mtp.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tokenmill.config import ConfigError
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.mtp_names import MTP_LAYER_KEYS, mtp_layer_index, num_mtp_layers
from tokenmill.models.registry import family_of
from tokenmill.models.safetensors_files import checkpoint_files, open_safetensors
from tokenmill.spec_decode.head_checkpoint import (
    fused_state,
    int8_drafts,
    load_checked_state,
    quantize_draft,
    speed_up_draft,
)
from tokenmill.spec_decode.mtp import MtpDraft

# Checkpoint name (after the layer's prefix) -> MtpDraft's, per layout; the rest is the
# decoder layer's. None: a copy of the target's tensor, not read.
_DEEPSEEK_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "norm.weight",
    "shared_head.head.weight": None,
    "embed_tokens.weight": None,
}
_QWEN3_NEXT_NAMES = {
    "pre_fc_norm_embedding.weight": "enorm.weight",
    "pre_fc_norm_hidden.weight": "hnorm.weight",
    "fc.weight": "eh_proj.weight",
    "norm.weight": "norm.weight",
}


def load_mtp(
    model_dir: str | Path,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    draft_weights: str = "full",
) -> MtpDraft:
    path = Path(model_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"speculative method mtp: no config.json in {path}")
    config = json.loads(config_file.read_text())
    num_mtp = num_mtp_layers(config)
    if num_mtp == 0:
        raise ConfigError(
            f"speculative method mtp: the checkpoint at {path} has no MTP layers (its "
            f"config.json sets none of {', '.join(MTP_LAYER_KEYS)})"
        )
    if num_mtp > 1:
        raise ConfigError(
            f"speculative method mtp: the checkpoint at {path} has {num_mtp} MTP layers; "
            "one is supported"
        )
    _check_family(target)
    tensors = _read_mtp_tensors(path, target.shape.num_layers)
    qwen3_next = any(name.startswith("mtp.") for name in tensors)
    names = _QWEN3_NEXT_NAMES if qwen3_next else _DEEPSEEK_NAMES
    prefix = "mtp." if qwen3_next else f"model.layers.{target.shape.num_layers}."
    renamed = []
    for name, tensor in tensors.items():
        short = name.removeprefix(prefix)
        if short in names:
            if names[short] is not None:
                renamed.append((names[short], tensor))
        elif qwen3_next:
            renamed.append((short, tensor))  # layers.0.*
        else:
            renamed.append((f"layers.0.{short}", tensor))
    with torch.device(device):
        draft = MtpDraft(target, post_norm_feature=qwen3_next)
    state = fused_state(renamed)
    load_checked_state(draft, {k: v.to(dtype) for k, v in state.items()}, path)
    draft.to(device=device, dtype=dtype)
    if int8_drafts(draft_weights, dtype, device):
        quantize_draft(draft, target)
    speed_up_draft(draft, dtype, device)
    return draft


def _check_family(target: LlamaForCausalLM) -> None:
    traits = target.traits
    if (
        family_of(target.architecture).mlp is not None
        or traits.sandwich_norms
        or traits.layer_windows is not None
        or target.tp.size > 1
    ):
        raise ConfigError(
            f"speculative method mtp supports dense Llama-family targets (Llama, Mistral, "
            f"Qwen2, Qwen3) on one rank; {target.architecture} is not one"
        )


def _read_mtp_tensors(path: Path, num_layers: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not __iter__)
                if mtp_layer_index(name, num_layers, 1) is not None:
                    tensors[name] = f.get_tensor(name)
    if not tensors:
        raise ConfigError(
            f"speculative method mtp: no MTP tensors in {path} (mtp.* as Qwen3-Next names "
            f"them, or model.layers.{num_layers}.* as DeepSeek-V3 does)"
        )
    return tensors
