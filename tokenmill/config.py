"""Every engine knob, with its default and its validation, in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# On CPU, with no memory budget given, the KV cache takes this much (vLLM's CPU backend takes
# 4 GiB by default; tokenmill targets small machines).
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


class ConfigError(ValueError):
    """An engine setting is invalid or inconsistent with the model."""


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclass
class SpeculativeConfig:
    """`--speculative-config` as vLLM takes it, e.g. `{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 5}` or `{"method": "draft_model",
    "model": PATH, "num_speculative_tokens": 4}`."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model's directory (draft_model)
    # Pick k per step (down to 0) from measured throughput; False: always num_speculative_tokens.
    adaptive: bool = True

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object")
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown speculative_config keys: {sorted(unknown)}")
        if "method" not in value:
            raise ConfigError("speculative_config needs a method: ngram or draft_model")
        value = {"num_speculative_tokens": 4, **value}
        return cls(**value)

    def __post_init__(self) -> None:
        _check_choice("speculative method", self.method, ("ngram", "draft_model"))
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")


@dataclass
class EngineConfig:
    """Engine settings. Field names follow vLLM's engine arguments and CLI flags."""

    model: str | None = None  # a local Hugging Face directory; None = the built-in default
    tokenizer: str | None = None  # defaults to `model`
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    # How linear layers run: auto = weights reordered for oneDNN on the CPU in float32
    # (layers/linear.py), else torch's F.linear; torch = always F.linear.
    linear_backend: str = "auto"
    # Where default sampling parameters come from, as vLLM's --generation-config: "auto" = the
    # model's generation_config.json (temperature, top_p, ... when it sets them), "vllm" =
    # none (temperature 1.0 etc.), or a directory holding a generation_config.json.
    generation_config: str = "auto"

    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit number of blocks, overrides the memory budget
    kv_cache_memory: int | None = None  # bytes for the KV cache
    gpu_memory_utilization: float = 0.9  # on CUDA: fraction of device memory for the engine
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 (= fp8_e4m3) | fp8_e5m2
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # recompute | swap
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks (swap mode only)

    # Scheduling
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority | static (the static-batching baseline)
    # Inter-token-latency target in milliseconds (None: off): each step gets only the prompt
    # tokens that a cost model learned from measured steps predicts to fit the target once the
    # running decodes are paid for (at least 16 per step, so long prompts still progress).
    itl_target_ms: float | None = None
    # vLLM's: at most this many prompt tokens per request and step (0: no cap)...
    long_prefill_token_threshold: int = 0
    # ...and at most this many prompts cut mid-way in one step (applies with a threshold or
    # an ITL target; with the token budget alone at most one prompt per step is cut).
    max_num_partial_prefills: int = 1

    # Speculative decoding: a SpeculativeConfig, or its dict / JSON form.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None

    # Tensor parallelism (one device here; kept so the flag has its home)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise ConfigError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        self._check_prefill_limits()
        _check_choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority", "static"))
        _check_choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", *KV_CACHE_DTYPES))
        _check_choice("linear_backend", self.linear_backend, ("auto", "torch"))
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.swap_space < 0:
            raise ConfigError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.tensor_parallel_size != 1:
            raise ConfigError("tensor_parallel_size > 1 is not supported yet")

    def _check_prefill_limits(self) -> None:
        if self.itl_target_ms is not None:
            if not self.itl_target_ms > 0:
                raise ConfigError(f"itl_target_ms must be > 0, got {self.itl_target_ms}")
            if not self.enable_chunked_prefill:
                raise ConfigError("itl_target_ms needs chunked prefill (prompts cut to fit)")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                f"long_prefill_token_threshold must be >= 0, got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.max_num_partial_prefills < 1:
            raise ConfigError(
                f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}"
            )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return model_dtype
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The compute dtype: the one asked for, or under `auto` the checkpoint's unless this
        device can't run it fast (CPUs without native bf16/fp16 matmuls get float32)."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        wanted = checkpoint_dtype or torch.float32
        if wanted == torch.float32 or self.torch_device().type == "cuda":
            return wanted
        return wanted if _cpu_has_fast_half_matmul() else torch.float32


def _cpu_has_fast_half_matmul() -> bool:
    cpu = getattr(torch._C, "_cpu", None)
    if cpu is None:
        return False
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)
