"""Multi-LoRA serving: peft adapters read and checked, kept loaded (an LRU in host memory),
installed into a model's decoder linears as stacked per-slot weights, and applied per token
after the base product (`docs/lora.md`)."""
