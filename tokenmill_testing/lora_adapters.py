"""Random peft LoRA adapters over a test checkpoint, saved as peft saves them, and the
reference they are held to: transformers with the adapter merged (peft's merge_and_unload),
float32."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_random_adapter(
    base_dir: str | Path,
    save_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
    seed: int = 0,
    **config: object,
) -> Path:
    """A peft adapter with random A and B (large enough to change greedy tokens) saved to
    `save_dir` (`adapter_config.json` + `adapter_model.safetensors`)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        init_lora_weights=False,
        **config,
    )
    model = get_peft_model(base, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5 / rank**0.5)
    model.save_pretrained(str(save_dir))
    return Path(save_dir)


def merged_reference(base_dir: str | Path, adapter_dir: str | Path | None) -> PreTrainedModel:
    """The base model in float32, with the adapter merged into its weights (None: the base)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return model.eval()
