"""`EngineConfig`: every engine knob, with its default, its help (the CLI flag is generated
from it) and its validation; the JSON-valued settings have their own modules."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from tokenmill.config import cpu_dtype
from tokenmill.config.base import ConfigError, check_choice, config_field
from tokenmill.config.kv_events import KVEventsConfig
from tokenmill.config.kv_transfer import KVTransferConfig
from tokenmill.config.speculative import MODEL_FREE_METHODS, SpeculativeConfig
from tokenmill.config.structured_outputs import StructuredOutputsConfig

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

# On CPU, with no memory budget given, the KV cache takes at most this much (and at most what
# the served limits use, or half the memory available: core/kv/sizing.py says why).
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


KV_CACHE_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


# auto: triton on CUDA when installed, else torch (layers/attention/selector.py).
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


# mp: rank processes this engine starts; ray: Ray actors placed by a placement group.
EXECUTOR_BACKENDS = ("mp", "ray")


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
        None, "local Hugging Face model directory or GGUF file (default: the built-in demo model)"
    )
    tokenizer: str | None = config_field(None, "tokenizer directory (default: the model's)")
    task: str = config_field(
        "auto",
        "generate, or a pooling task: embed (embeddings), score (cross-encoder scores); "
        "auto: from the checkpoint (a sentence-transformers directory or a *Model: embed, "
        "*ForSequenceClassification: score, else generate)",
        choices=("auto", "generate", "embed", "score"),
    )
    dtype: str = config_field(
        "auto",
        "compute dtype; auto: the checkpoint's, but bfloat16 for float32 checkpoints on CPUs "
        "with native bf16 (AVX512_BF16/AMX) and float32 where a CPU has no fast half (a "
        "bfloat16 decoder stays bfloat16 under the native kernels)",
        choices=("auto", *_DTYPES),
    )
    device: str = config_field("auto", "auto, cpu, cuda or cuda:N")
    seed: int = config_field(0, "seed of the random numbers of unseeded requests")
    linear_backend: str = config_field(
        "auto",
        "auto: on the CPU, linear weights packed for the native kernels (oneDNN-reordered "
        "where they do not build; layers/linear.py), else F.linear; torch: always F.linear",
        choices=("auto", "torch"),
    )
    quantization: str | None = config_field(
        None,
        "quantize the decoder's linear weights at load time: int8 (per output channel) or "
        "int4 (asymmetric groups of 32; int4-g128: of 128); on the CPU native kernels, "
        "elsewhere dequantized per product by torch ops; the embedding and LM head "
        "choose their own format (int8 per row). Pre-quantized checkpoints (a .gguf file, a "
        "quantization_config) are detected without it (docs/quantization.md)",
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
        "KV cache size in bytes (default on the CPU: the smallest of max_num_seqs x "
        "max_model_len, 2 GiB and half the memory available, resident only as used; on CUDA "
        "from --gpu-memory-utilization)",
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
        None,
        "longest sequence, prompt and output (default: the model's max_position_embeddings, "
        "at most 1048576); the RoPE tables and the KV cache are sized for it",
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
    pipeline_parallel_size: int = config_field(
        1,
        "pipeline stages (processes) to split the decoder layers over, each running its own "
        "layers (tensor_parallel_size ranks per stage); the engine starts them "
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
    distributed_executor_backend: str = config_field(
        "mp",
        "how the tensor-parallel ranks start: mp (processes on this machine) or ray (Ray actors "
        "on a running Ray cluster, or a local one; pip install 'tokenmill[ray]') "
        "(docs/scale_out.md)",
        choices=EXECUTOR_BACKENDS,
    )

    kv_transfer_config: KVTransferConfig | None = config_field(
        None,
        'JSON, e.g. \'{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"shared_storage_path": DIR}}\' (docs/scale_out.md)',
    )
    kv_events_config: KVEventsConfig | None = config_field(
        None,
        'JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": '
        '"tcp://*:5557", "topic": "kv-events"}\': prefix-cache blocks stored and removed, in '
        "vLLM's event format, for llm-d's and vLLM router's prefix-aware routing "
        "(docs/scale_out.md)",
    )

    enable_lora: bool = config_field(
        False, "serve LoRA adapters (peft) on the base model, mixed in one step (docs/lora.md)"
    )
    max_loras: int = config_field(1, "LoRA adapters resident at once: the most in one step")
    max_lora_rank: int = config_field(16, "the highest LoRA rank an adapter may have")
    max_cpu_loras: int | None = config_field(
        None, "LoRA adapters kept loaded in host memory (default: max_loras)"
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata["choices"] is not None and getattr(self, f.name) is not None:
                check_choice(f.name, getattr(self, f.name), f.metadata["choices"])
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
        self._check_executor_backend()
        self._check_pipeline_parallel()
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        self._check_kv_transfer()
        self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        self._check_lora()

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

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
        if spec is not None and spec.method not in MODEL_FREE_METHODS:
            raise ConfigError(
                "with tensor_parallel_size > 1 only ngram and suffix speculation are supported"
            )
        if self.enforce_eager is False:  # collectives inside a captured step: not built yet
            raise ConfigError("tensor_parallel_size > 1 runs eager steps: leave enforce_eager on")

    def _check_executor_backend(self) -> None:
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ConfigError(
                "distributed_executor_backend 'ray' places every rank itself: leave nnodes at 1 "
                "(nnodes is the mp backend's way across machines)"
            )

    def _check_pipeline_parallel(self) -> None:
        size = self.pipeline_parallel_size
        if size < 1:
            raise ConfigError(f"pipeline_parallel_size must be >= 1, got {size}")
        if size == 1:
            return
        refused = [
            (self.speculative_config is not None, "speculative decoding (speculative_config)"),
            (self.enforce_eager is False, "captured decode steps (enforce_eager=False)"),
            (self.kv_transfer_config is not None, "KV connectors (kv_transfer_config)"),
            (self.enable_lora, "LoRA (enable_lora)"),
            (self.quantization is not None, "online quantization (quantization)"),
            (self.nnodes > 1, "ranks on several machines (nnodes > 1)"),
        ]
        for unsupported, feature in refused:
            if unsupported:
                raise ConfigError(
                    f"pipeline_parallel_size > 1 does not support {feature}; it runs float "
                    "checkpoints of the shared decoder families on one machine, with tensor "
                    "parallelism, chunked prefill, prefix caching and preemption"
                )

    def _check_kv_transfer(self) -> None:
        if self.kv_transfer_config is None:
            return
        if self.tensor_parallel_size > 1:  # each rank would move its own shard: not built yet
            raise ConfigError("kv_transfer_config needs tensor_parallel_size 1 (not built yet)")
        spec = self.speculative_config
        if spec is not None and spec.method not in MODEL_FREE_METHODS:  # a draft's KV stays
            raise ConfigError("kv_transfer_config supports only ngram and suffix speculation")

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

    def torch_dtype(
        self, checkpoint_dtype: torch.dtype | None, compute_bound: bool = False
    ) -> torch.dtype:
        """The compute dtype: the one asked for, or under `auto` the checkpoint's, except on a
        CPU: float32 checkpoints run in bfloat16 where the CPU multiplies bf16 natively
        (AVX512_BF16 or AMX; vLLM's CPU backend does the same), half ones in float32 where it
        does not, except a bfloat16 decoder's under the native kernels, which read its bytes
        as they are (`cpu_dtype.native_kernels_enabled`). Measured on an Intel Xeon with AMX
        (SmolLM2-135M shape, process CPU ms per decode step, one thread, the native kernels):
        bfloat16 takes 0.67x, 0.53x and 0.48x of float32's time at 1, 16 and 64 rows
        (docs/benchmarks.md, "dtype auto").
        An explicit `float32` stays exact. `compute_bound` (an encoder's forward: products of
        thousands of rows, no weight-bandwidth to save): bfloat16 only where its products
        outpace float32's (`cpu_dtype.cpu_bf16_outpaces_f32`)."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, _DTYPES[self.dtype])
        wanted = checkpoint_dtype or torch.float32
        if self.torch_device().type == "cuda":
            return wanted
        fast_half = cpu_dtype.cpu_has_fast_half_matmul()
        if compute_bound:
            fast_half = fast_half and cpu_dtype.cpu_bf16_outpaces_f32()
        if wanted == torch.float32:
            return torch.bfloat16 if fast_half else torch.float32
        if wanted == torch.bfloat16 and not compute_bound and cpu_dtype.native_kernels_enabled():
            return wanted  # the native products widen bf16 in registers: half the bytes to read
        return wanted if fast_half else torch.float32
