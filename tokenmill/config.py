"""Every engine knob, with its default and its validation, in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Names of torch dtypes, not the dtypes: importing torch here would make `tokenmill --help`
# wait seconds for it.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}

# On CPU, with no memory budget given, the KV cache takes this much (vLLM's CPU backend takes
# 4 GiB by default; tokenmill targets small machines).
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


KV_CACHE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


# auto: triton on CUDA when installed, else torch (layers/attention_backends.py).
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


class ConfigError(ValueError):
    """An engine setting is invalid or inconsistent with the model."""


def json_config_fields(value: str | dict[str, Any], name: str, cls: type) -> dict[str, Any]:
    """A JSON-valued setting (`--speculative-config '{...}'` or a dict) as a dict whose keys are
    fields of the dataclass `cls`; one ConfigError naming the setting otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object")
    unknown = set(value) - {f.name for f in fields(cls)}
    if unknown:
        raise ConfigError(f"unknown {name} keys: {sorted(unknown)}")
    return value


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


# ngram: prompt lookup; draft_model: a smaller model; eagle / medusa: heads on the target.
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "medusa")


@dataclass
class SpeculativeConfig:
    """`--speculative-config` as vLLM takes it, e.g. `{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 5}`, `{"method": "draft_model",
    "model": PATH, "num_speculative_tokens": 4}`, or `{"method": "eagle"}` / `{"method":
    "medusa"}` with `model` the heads' directory (default: the demo target's heads)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model's (draft_model) or the heads' directory
    # Pick k per step (down to 0) from measured throughput; False: always num_speculative_tokens.
    adaptive: bool = True
    # EAGLE's layer and LM head for drafting: "int8" weights (a quarter of the bytes a draft
    # streams), "full" (the model's dtype), "auto" (int8 on the CPU in float32 where torch has
    # the kernel). Drafts only: verification is the target's, in its own dtype.
    draft_weights: str = "auto"

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_config_fields(value, "speculative_config", cls)
        if "method" not in value:
            raise ConfigError(
                f"speculative_config needs a method: one of {', '.join(SPECULATIVE_METHODS)}"
            )
        value = {"num_speculative_tokens": 4, **value}
        for name, given in value.items():
            _check_json_type(name, given, SPECULATIVE_FIELD_TYPES[name])
        return cls(**value)

    def __post_init__(self) -> None:
        _check_choice("speculative method", self.method, SPECULATIVE_METHODS)
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        _check_choice("speculative draft_weights", self.draft_weights, ("auto", "int8", "full"))


# The JSON types each `--speculative-config` key takes (bool is not an int here).
SPECULATIVE_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "method": (str,),
    "num_speculative_tokens": (int,),
    "prompt_lookup_min": (int,),
    "prompt_lookup_max": (int,),
    "model": (str, type(None)),
    "adaptive": (bool,),
    "draft_weights": (str,),
}
_JSON_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", type(None): "null"}


def _check_json_type(name: str, given: Any, allowed: tuple[type, ...]) -> None:
    if type(given) in allowed:  # exact: True is not an integer, 4.0 is not one either
        return
    expected = " or ".join(_JSON_TYPE_NAMES[t] for t in allowed)
    raise ConfigError(f"speculative_config {name} must be {expected}, got {json.dumps(given)[:80]}")


# Structured outputs: the backends vLLM names; "auto" and "xgrammar" both mean xgrammar, the
# only one here.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    """`--structured-outputs-config` as vLLM takes it (JSON), e.g. `{"max_whitespace": null}`.
    vLLM's keys: `backend`, `disable_any_whitespace`; the rest bound what one tenant's schema
    can cost everyone else (docs/server.md, "Structured outputs")."""

    backend: str = "auto"
    disable_any_whitespace: bool = False  # every request's JSON compact, as if it asked
    # Whitespace characters allowed between two JSON tokens (1: `{"a": 1}` or a newline, not
    # an indented line); None: any amount, which a small model at temperature 1 spends
    # padding to max_tokens with spaces and newlines.
    max_whitespace: int | None = 1
    # Bytes of a schema, regex, grammar or choice list (as JSON text); larger ones are a 400.
    max_schema_bytes: int = 64 * 1024
    # Seconds a request waits for its grammar to compile; past it, a 400 (a request of the
    # offline API ends with finish_reason "error").
    compile_timeout: float = 30.0
    # Compiled grammars kept, by xgrammar's own size of each (vLLM's default, 512 MiB).
    cache_max_bytes: int = 512 * 1024**2

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | StructuredOutputsConfig | None
    ) -> StructuredOutputsConfig:
        if value is None or isinstance(value, StructuredOutputsConfig):
            return value or cls()
        value = json_config_fields(value, "structured_outputs_config", cls)
        return cls(**value)

    def __post_init__(self) -> None:
        _check_choice(
            "structured_outputs_config backend", self.backend, STRUCTURED_OUTPUTS_BACKENDS
        )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ConfigError("structured_outputs_config disable_any_whitespace must be a boolean")
        if self.max_whitespace is not None and not _positive_int(self.max_whitespace):
            raise ConfigError(
                "structured_outputs_config max_whitespace must be a positive integer or null "
                f"(any whitespace), got {self.max_whitespace!r}"
            )
        for name in ("max_schema_bytes", "cache_max_bytes"):
            if not _positive_int(getattr(self, name)):
                raise ConfigError(
                    f"structured_outputs_config {name} must be a positive integer, "
                    f"got {getattr(self, name)!r}"
                )
        timeout = self.compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ConfigError(
                f"structured_outputs_config compile_timeout must be > 0 s, got {timeout!r}"
            )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def config_field(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    flags: tuple[str, ...] = (),
) -> Any:
    """A config field that also describes its CLI flag (entrypoints/engine_args.py): `help`,
    `choices` (also checked by `EngineConfig.__post_init__`) and `flags`, the flag names when
    they differ from the field's (vLLM's name first, older names after it as aliases)."""
    metadata: dict[str, Any] = {"help": help, "choices": choices, "flags": flags}
    return field(default=default, metadata=metadata)


# fcfs: continuous batching in arrival order. priority: by (priority, arrival), lowest value
# first, and the lowest-priority running request is preempted first. static: the baseline that
# continuous batching is measured against: a batch is what one step admits, and nobody joins
# until every member has finished.
SCHEDULING_POLICIES = ("fcfs", "priority", "static")
# When KV blocks run out, the victim's KV is recomputed later, or swapped to host memory.
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class EngineConfig:
    """Engine settings. Field names follow vLLM's engine arguments; every field is also a CLI
    flag of `tokenmill serve | generate | bench throughput | eval`, generated from it."""

    model: str | None = config_field(
        None, "local Hugging Face model directory (default: the built-in demo model)"
    )
    tokenizer: str | None = config_field(None, "tokenizer directory (default: the model's)")
    dtype: str = config_field(
        "auto",
        "compute dtype; auto takes the checkpoint's unless this CPU can't run it fast",
        choices=("auto", *_DTYPES),
    )
    device: str = config_field("auto", "auto, cpu, cuda or cuda:N")
    seed: int = config_field(0, "seed of the random numbers of unseeded requests")
    linear_backend: str = config_field(
        "auto",
        "auto: linear weights reordered for oneDNN on the CPU in float32 (layers/linear.py), "
        "else F.linear; torch: always F.linear",
        choices=("auto", "torch"),
    )
    quantization: str | None = config_field(
        None,
        "quantize the decoder's linear weights at load time: int8 (per output channel) or "
        "int4 (asymmetric groups of 32; int4-g128: of 128), weight-only, CPU; the embedding "
        "and LM head keep the model's dtype. Pre-quantized checkpoints (a .gguf file) are "
        "detected without it (docs/quantization.md)",
        choices=("int8", "int4", "int4-g128"),
        flags=("--quantization", "-q"),
    )
    attention_backend: str = config_field(
        "auto",
        "auto: the Triton paged-attention kernel on CUDA when triton is installed, cpu on "
        "the CPU (native kernels reading the paged cache in place for short queries, "
        "kernels/), else torch (the portable reference: gather + "
        "scaled_dot_product_attention)",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool | None = config_field(
        None,
        "run every step eagerly (vLLM's flag); the default until the captured path has run on "
        "a GPU. --no-enforce-eager: decode-only steps run captured at padded batch sizes, as "
        "CUDA graphs on a GPU (not yet run on one) and compiled by torch.compile on the CPU "
        "(about a minute of CPU per batch size and context length bucket, on a restart too; "
        "faster at batch 1 only: docs/benchmarks.md)",
    )
    generation_config: str = config_field(
        "auto",
        "default sampling parameters (as vLLM): auto = the model's generation_config.json, "
        "vllm = none (temperature 1.0), or a directory holding a generation_config.json",
    )

    # KV cache
    block_size: int = config_field(16, "tokens per KV cache block")
    num_kv_blocks: int | None = config_field(
        None,
        "KV cache size in blocks; overrides the memory budget",
        flags=("--num-gpu-blocks-override", "--num-kv-blocks"),
    )
    kv_cache_memory: int | None = config_field(
        None,
        "KV cache size in bytes (default: 2 GiB on the CPU; on CUDA from --gpu-memory-utilization)",
        flags=("--kv-cache-memory-bytes", "--kv-cache-memory"),
    )
    gpu_memory_utilization: float = config_field(
        0.9, "on CUDA: fraction of device memory the engine may use"
    )
    kv_cache_dtype: str = config_field(
        "auto",
        "KV cache storage: auto = the model's dtype; fp8 (= fp8_e4m3) halves a 16-bit cache",
        choices=("auto", *KV_CACHE_DTYPES),
    )
    enable_prefix_caching: bool = config_field(True, "reuse the KV of prompt prefixes seen before")
    preemption_mode: str = config_field(
        "recompute",
        "when KV blocks run out: recompute the victim later, or swap its KV to host memory",
        choices=PREEMPTION_MODES,
    )
    swap_space: float = config_field(
        4.0, "GiB of host memory for swapped-out KV blocks (swap mode only)"
    )

    # Scheduling
    max_model_len: int | None = config_field(
        None, "longest sequence, prompt and output (default: the model's max_position_embeddings)"
    )
    max_num_batched_tokens: int = config_field(2048, "the token budget of one step")
    max_num_seqs: int = config_field(256, "most requests in one step")
    enable_chunked_prefill: bool = config_field(True, "split long prompts across steps")
    scheduling_policy: str = config_field(
        "fcfs",
        "fcfs: continuous batching; priority: by request priority (lower first); "
        "static: the run-each-batch-to-the-end baseline",
        choices=SCHEDULING_POLICIES,
    )
    itl_target_ms: float | None = config_field(
        None,
        "inter-token-latency target in ms: each step gets only the prompt tokens that a cost "
        "model learned from measured steps predicts to fit it once the running decodes are "
        "paid for (and at least half the decodes' time, so long prompts still progress); "
        "off by default",
    )
    long_prefill_token_threshold: int = config_field(
        0, "at most this many prompt tokens per request and step (0: no cap)"
    )
    max_num_partial_prefills: int = config_field(
        1,
        "at most this many prompts cut mid-way in one step (applies with a threshold or an "
        "ITL target; with the token budget alone at most one prompt per step is cut)",
    )

    speculative_config: SpeculativeConfig | None = config_field(
        None,
        'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft_model", "model": PATH}\' (the demo target has a default draft)',
    )

    structured_outputs_config: StructuredOutputsConfig | None = config_field(
        None,
        "JSON, e.g. '{\"max_whitespace\": null}' (free whitespace in JSON) or "
        '\'{"max_schema_bytes": 131072, "compile_timeout": 60}\' (docs/server.md)',
    )

    tensor_parallel_size: int = config_field(
        1,
        "ranks (processes; devices on CUDA) to shard the model over; the engine starts them "
        "(docs/scale_out.md)",
    )
    nnodes: int = config_field(
        1,
        "machines the tensor-parallel ranks span: this one starts tensor_parallel_size/nnodes "
        "ranks (rank 0 first), each other one runs `tokenmill tp-worker --node-rank K`; needs "
        "MASTER_ADDR and MASTER_PORT (docs/scale_out.md)",
    )
    distributed_timeout: float = config_field(
        60.0,
        "seconds a tensor-parallel rank waits for its peers in a collective before the engine "
        "fails (a hung worker)",
    )

    kv_transfer_config: KVTransferConfig | None = config_field(
        None,
        'JSON, e.g. \'{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"shared_storage_path": DIR}}\' (docs/scale_out.md)',
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata["choices"] is not None and getattr(self, f.name) is not None:
                _check_choice(f.name, getattr(self, f.name), f.metadata["choices"])
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
        if not isinstance(self.speculative_config, SpeculativeConfig | None):
            raise ConfigError(
                "speculative_config must be a SpeculativeConfig or None "
                "(SpeculativeConfig.parse reads its dict or JSON form)"
            )
        self.structured_outputs_config = StructuredOutputsConfig.parse(
            self.structured_outputs_config
        )
        if self.swap_space < 0:
            raise ConfigError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        self._check_tensor_parallel()
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        self._check_kv_transfer()

    def _check_tensor_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.distributed_timeout > 0:
            raise ConfigError(f"distributed_timeout must be > 0 s, got {self.distributed_timeout}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ConfigError(
                f"nnodes must divide tensor_parallel_size ({self.tensor_parallel_size}), "
                f"got {self.nnodes}"
            )
        if self.tensor_parallel_size == 1:
            return
        spec = self.speculative_config
        if spec is not None and spec.method != "ngram":
            raise ConfigError("with tensor_parallel_size > 1 only ngram speculation is supported")
        if self.enforce_eager is False:  # collectives inside a captured step: not built yet
            raise ConfigError("tensor_parallel_size > 1 runs eager steps: leave enforce_eager on")

    def _check_kv_transfer(self) -> None:
        if self.kv_transfer_config is None:
            return
        if self.tensor_parallel_size > 1:  # each rank would move its own shard: not built yet
            raise ConfigError("kv_transfer_config needs tensor_parallel_size 1 (not built yet)")
        spec = self.speculative_config
        if spec is not None and spec.method != "ngram":  # a draft's own KV is not moved
            raise ConfigError("kv_transfer_config supports only ngram speculation")

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

    def captures_decode(self, device: torch.device) -> bool:
        """Whether decode-only steps run captured (`worker/captured_step.py`)."""
        if self.enforce_eager is None:
            return False  # until the CUDA graphs have run on a GPU (issue 14)
        return not self.enforce_eager

    def linear_backend_for(self, device: torch.device) -> str:
        """Inductor cannot compile oneDNN-reordered linears (layers/linear.py): a compiled CPU
        decode step needs plain `nn.Linear` weights (eager steps then use them too)."""
        if device.type == "cpu" and self.captures_decode(device):
            return "torch"
        return self.linear_backend

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        import torch

        if self.kv_cache_dtype == "auto":
            return model_dtype
        return getattr(torch, KV_CACHE_DTYPES[self.kv_cache_dtype])

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The compute dtype: the one asked for, or under `auto` the checkpoint's unless this
        device can't run it fast (CPUs without native bf16/fp16 matmuls get float32)."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, _DTYPES[self.dtype])
        wanted = checkpoint_dtype or torch.float32
        if wanted == torch.float32 or self.torch_device().type == "cuda":
            return wanted
        return wanted if _cpu_has_fast_half_matmul() else torch.float32


def _cpu_has_fast_half_matmul() -> bool:
    import torch

    cpu = getattr(torch._C, "_cpu", None)
    if cpu is None:
        return False
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


# kv_producer: saves the KV it computes; kv_consumer: loads KV computed elsewhere; kv_both.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE = ("fail", "recompute")


@dataclass
class KVTransferConfig:
    """`--kv-transfer-config` as vLLM takes it, e.g. `{"kv_connector": "SharedStorageConnector",
    "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": DIR}}`: which
    KV connector moves KV blocks in and out of this engine (tokenmill/kv_transfer/)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # Point-to-point connectors: where a producer listens for its consumers (0: a free port),
    # this engine's name in transfers (default: one made at start), and what a consumer does when
    # KV fails to arrive: end the request with an error ("fail") or compute it ("recompute").
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None
    kv_load_failure_policy: str = "fail"

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | KVTransferConfig | None
    ) -> KVTransferConfig | None:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_config_fields(value, "kv_transfer_config", cls)
        if "kv_connector" not in value:
            raise ConfigError("kv_transfer_config needs a kv_connector (its name)")
        return cls(**value)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ConfigError(f"kv_connector must be a connector name, got {self.kv_connector!r}")
        _check_choice("kv_role", self.kv_role, KV_ROLES)
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_connector_extra_config must be a JSON object")
        _check_choice("kv_load_failure_policy", self.kv_load_failure_policy, KV_LOAD_FAILURE)
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_port must be a port number (0: any free), got {self.kv_port!r}")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ConfigError(f"kv_ip must be an address, got {self.kv_ip!r}")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
