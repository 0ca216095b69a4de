"""`LoRARequest`: which adapter a request runs with (vLLM's `LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique to it, and the directory peft saved it
    to (`adapter_config.json` + `adapter_model.safetensors`). Requests with the same id share
    the adapter (and its prefix-cache entries); id 0 is the base model."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # the served model it is listed under (/v1/models)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
