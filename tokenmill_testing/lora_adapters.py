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


def save_gguf_adapter(adapter_dir: str | Path, base_dir: str | Path, path: str | Path) -> Path:
    """The peft adapter at `adapter_dir` as llama.cpp's convert_lora_to_gguf.py writes it for
    a Llama base (float32): its metadata, `blk.N.<tensor>.weight.lora_a/lora_b`, and q's and
    k's B rows permuted per head as llama.cpp's converter permutes q/k weights."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((Path(base_dir) / "config.json").read_text())
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    alpha = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["lora_alpha"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    for key, tensor in sorted(tensors.items()):
        layer = key.split(".layers.")[1].split(".")[0]
        module = key.split(".lora_")[0].rsplit(".", 1)[1]
        half = "a" if ".lora_A." in key else "b"
        if half == "b" and module in heads:
            n = heads[module]
            shape = tensor.shape
            tensor = tensor.reshape(n, 2, shape[0] // n // 2, *shape[1:]).swapaxes(1, 2)
            tensor = tensor.reshape(shape)
        name = f"blk.{layer}.{names[module]}.weight.lora_{half}"
        writer.add_tensor(name, tensor.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
