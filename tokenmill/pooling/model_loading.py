"""Loading a pooling model: a BERT-family encoder (models/bert.py) name for name, or a
Llama-family decoder (models/llama.py) whose last hidden states are pooled (Qwen3-Embedding:
saved by sentence-transformers as `Qwen3Model`, without an LM head)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from tokenmill.layers.linear import (
    OneDNNLinearMethod,
    onednn_linear_available,
    process_linears_after_loading,
    replace_linears,
)
from tokenmill.layers.parallel import SINGLE
from tokenmill.models.bert import ENCODER_ARCHITECTURES, BertEncoder
from tokenmill.models.config_checks import ModelLoadError
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.llama_stack import build_decoder_stack
from tokenmill.models.loader import LoadSettings, load_weights
from tokenmill.models.safetensors_files import checkpoint_files, open_safetensors, tensor_shapes
from tokenmill.quantization.selection import LinearPlan

# Decoder architectures whose hidden states can be pooled -> the Llama-family member they are.
DECODER_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "LlamaForCausalLM": "LlamaForCausalLM",
    "MistralForCausalLM": "MistralForCausalLM",
    "Qwen2ForCausalLM": "Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "Qwen3ForCausalLM",
}


@dataclass
class PoolingModel:
    """A loaded pooling model: an encoder or a decoder, never both."""

    hf_config: Any
    architecture: str
    encoder: BertEncoder | None = None
    decoder: LlamaForCausalLM | None = None

    @property
    def is_decoder(self) -> bool:
        return self.decoder is not None

    @property
    def max_tokens(self) -> int:
        if self.encoder is not None:
            return self.encoder.shape.max_tokens
        assert self.decoder is not None
        return self.decoder.rotary.max_position


def pooling_architecture(model_dir: Path) -> str:
    """The checkpoint's first architecture that tokenmill pools; a clear error otherwise."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{model_dir} is not a Hugging Face model directory: no config.json")
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ModelLoadError(f"{config_file} could not be read: {e}") from e
    known = {**ENCODER_ARCHITECTURES, **DECODER_ARCHITECTURES}
    for name in architectures:
        if name in known:
            return name
    raise ModelLoadError(
        f"unsupported architecture {architectures or '(none given)'} in {config_file} for "
        f"pooling; tokenmill pools {sorted(known)}"
    )


def load_pooling_model(
    model_dir: str | Path, settings: LoadSettings, device: torch.device
) -> PoolingModel:
    path = Path(model_dir)
    architecture = pooling_architecture(path)
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises several types for a bad config
        raise ModelLoadError(f"{path / 'config.json'} could not be read: {e}") from e
    if architecture in ENCODER_ARCHITECTURES:
        encoder = _load_encoder(path, hf_config, architecture, settings, device)
        return PoolingModel(hf_config, architecture, encoder=encoder)
    decoder = _load_decoder(path, hf_config, DECODER_ARCHITECTURES[architecture], settings, device)
    return PoolingModel(hf_config, architecture, decoder=decoder)


def _load_encoder(
    path: Path, hf_config: Any, architecture: str, settings: LoadSettings, device: torch.device
) -> BertEncoder:
    try:
        with torch.device(device):
            model = BertEncoder(hf_config, architecture)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        with open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not __iter__)
                target = model.parameter_name(name)
                if target is None:
                    continue
                if target not in params:
                    raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint at {path}")
                tensor = f.get_tensor(name)
                if tensor.shape != params[target].shape:
                    raise ModelLoadError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                        f"{tuple(params[target].shape)}"
                    )
                params[target].data.copy_(tensor)
                loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelLoadError(f"the checkpoint at {path} lacks tensors for {missing}")
    model = model.to(dtype=settings.dtype).eval().requires_grad_(False)
    model.fuse_qkv()
    replace_linears(model, _encoder_linear_chooser(settings, device))
    process_linears_after_loading(model)
    return model


def _encoder_linear_chooser(settings: LoadSettings, device: torch.device) -> Any:
    """The dense linears as the decoders have them (the native packed layout on the CPU),
    but oneDNN's for an encoder on the CPU in float32, or bfloat16 where oneDNN has native
    bf16: at an encoder step's thousands of rows it beat the packed kernels there (the whole
    forward 1.3x in float32 and bfloat16 on a Zen 4), and it fuses the bias and GELU into the
    MLP's product."""
    if settings.linear_backend == "auto" and device.type == "cpu" and onednn_linear_available():
        dtype = settings.dtype
        if dtype == torch.float32 or (
            dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ):
            return lambda name, linear: OneDNNLinearMethod(dtype, pad_rows=False)
    return LinearPlan.online(settings.dtype, device, settings.linear_backend, None, False).choose


def _load_decoder(
    path: Path, hf_config: Any, architecture: str, settings: LoadSettings, device: torch.device
) -> LlamaForCausalLM:
    """As models/loader.py's `load_model` for a float checkpoint. Without an LM head in the
    checkpoint (sentence-transformers saves none: an embedder never computes logits) the head
    is tied to the embedding; a yes/no reranker keeps its own."""
    if "lm_head.weight" not in tensor_shapes(path):
        hf_config.tie_word_embeddings = True
    with torch.device(device):
        model = LlamaForCausalLM(
            hf_config,
            architecture,
            settings.dtype,
            SINGLE,
            settings.attention_backend,
            settings.max_model_len,
        )
    model.to(dtype=settings.dtype)
    plan = LinearPlan.online(settings.dtype, device, settings.linear_backend, None, False)
    linears = replace_linears(model, plan.choose)
    load_weights(model, _tensors(path), linears, path)
    process_linears_after_loading(model)
    model.eval().requires_grad_(False)
    if settings.attention_backend == "cpu":
        model.decoder_stack = build_decoder_stack(model)
    return model


def _tensors(path: Path) -> Any:
    for file in checkpoint_files(path):
        with open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118
                yield name, (lambda part, f=f, name=name: f.get_tensor(name))
