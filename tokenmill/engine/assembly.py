"""The engine's parts, built from its config once, in dependency order: how models load, the
target (rank 0's shard, the other ranks started first), the context length, the KV cache's
size and manager, the draft and its proposer, the runner, the KV connectors, the scheduler
and the grammar compiler. `LLMEngine` only runs them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from tokenmill.config import ConfigError, EngineConfig, SpeculativeConfig
from tokenmill.core.feedback.cost_model import StepCostModel
from tokenmill.core.feedback.prefill_budget import PrefillLimits
from tokenmill.core.feedback.speculation_policy import SpeculationPolicy
from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.kv.sizing import kv_cache_size, kv_groups_for, num_swap_blocks
from tokenmill.core.sched.lora_admission import limit_lora_adapters
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.engine.hybrid import (
    attach_state_cache,
    blocks_after_states,
    check_hybrid_config,
    fit_state_slots,
    is_hybrid,
    num_state_slots,
)
from tokenmill.engine.kv_events import ZmqEventPublisher
from tokenmill.engine.speculation_parts import load_draft, make_proposer
from tokenmill.kv_transfer.base import KVConnectorBase, KVConnectorContext, KVConnectorPair
from tokenmill.kv_transfer.factory import create_connector_pair
from tokenmill.kv_transfer.fingerprint import model_fingerprint, transfer_fingerprint
from tokenmill.layers.attention.selector import resolve_attention_backend
from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.layers.kv_groups import KVGroupLayout
from tokenmill.layers.parallel import SINGLE
from tokenmill.lora.adapter_store import LoRAAdapterStore
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import (
    LoadSettings,
    checkpoint_dtype,
    eos_token_ids,
    load_hf_config,
    load_model,
    load_tokenizer,
    sampling_defaults,
)
from tokenmill.models.pipeline_split import WHOLE, stage_layer_ranges
from tokenmill.quantization.selection import weight_format_summary
from tokenmill.sampling_params import InvalidRequestError, SamplingParams
from tokenmill.spec_decode.eagle import EagleDraft
from tokenmill.spec_decode.medusa import MedusaHeads
from tokenmill.spec_decode.mtp import MtpDraft
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.worker.calibration import calibrate
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.runner_spec import RunnerSpec
from tokenmill.worker.tp_executor import TensorParallelExecutor

logger = logging.getLogger(__name__)

# The default max_model_len's ceiling: above the longest context a supported model family
# publishes (Mistral Nemo: 1,024,000; Qwen2.5-1M: 1,010,000).
DEFAULT_MAX_MODEL_LEN_CAP = 1 << 20


@dataclass
class EngineParts:
    """What `assemble` builds: `LLMEngine` keeps it whole, as `parts`, and copies none of it."""

    model_dir: Path
    architecture: str
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # resolved: torch, cpu or triton
    weight_format: str  # what the linears hold (/v1/models, the start-up log)
    executor: TensorParallelExecutor | None  # ranks 1..N-1 under tensor parallelism
    max_model_len: int
    vocab_size: int
    eos_token_ids: set[int]
    default_sampling: dict[str, Any]  # from generation_config.json
    kv_cache_manager: KVCacheManager
    runner: ModelRunner
    kv_connectors: KVConnectorPair | None
    scheduler: Scheduler
    structured_output: StructuredOutputManager
    lora_store: LoRAAdapterStore | None = None  # the loaded LoRA adapters (--enable-lora)
    kv_events: ZmqEventPublisher | None = None  # the prefix cache's events (--kv-events-config)


def assemble(config: EngineConfig) -> EngineParts:
    if config.model is None:
        raise ConfigError("no model given: set EngineConfig.model to a checkpoint directory")
    model_dir = Path(config.model)
    hf_config, architecture = load_hf_config(model_dir)
    if is_hybrid(architecture):
        check_hybrid_config(config, architecture)
    stage_layer_ranges(hf_config.num_hidden_layers, config.pipeline_parallel_size)  # checked
    max_model_len = _max_model_len(config, hf_config.max_position_embeddings)
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    device = config.torch_device()
    settings = LoadSettings(
        dtype=config.torch_dtype(checkpoint_dtype(hf_config)),
        linear_backend=config.linear_backend_for(device),
        attention_backend=resolve_attention_backend(config.attention_backend, device),
        quantization=config.quantization,
        max_model_len=max_model_len,
    )
    torch.manual_seed(config.seed)
    # Tensor parallelism: this process is rank 0; the executor starts ranks 1..N-1, which load
    # their shards while this one loads its own.
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    executor = TensorParallelExecutor(config, settings) if ranks > 1 else None
    tp, stage = (executor.tp, executor.stage) if executor else (SINGLE, WHOLE)
    model = load_model(model_dir, settings, device, tp, stage)
    if is_hybrid(architecture):  # the state slots must leave room for KV blocks
        config = fit_state_slots(config, model.state_spec.bytes_per_slot, device)
    default_sampling = _default_sampling(config, model_dir)
    kv_spec = _kv_spec(config, model, settings.dtype)  # a hybrid model's attention layers only
    window = model.shape.sliding_window  # model-wide (Mistral), where layers do not differ
    windows = model.traits.layer_windows or ([window] * kv_spec.num_layers if window else None)
    kv_groups = kv_groups_for(config, windows, kv_spec.num_layers, max_model_len)
    kv_spec = replace(kv_spec, num_layers=kv_groups.width)
    if config.pipeline_parallel_size > 1:  # sized for the largest stage; each rank caches its own
        ranges = stage_layer_ranges(model.shape.num_layers, config.pipeline_parallel_size)
        kv_spec = replace(kv_spec, num_layers=max(end - start for start, end in ranges))
    runner, kv_cache_manager, draft_has_kv, kv_size_reason = _runner(
        config, model, settings, device, executor, kv_spec, max_model_len, kv_groups
    )
    lora_store = _lora(config, runner)
    kv_connectors = _kv_connectors(config, model_dir, settings, kv_spec, kv_cache_manager)
    if kv_connectors is not None:
        runner.use_kv_connector(kv_connectors.worker)
    scheduler = _scheduler(
        config,
        runner,
        kv_cache_manager,
        max_model_len,
        spec_lookahead=draft_has_kv,
        kv_connector=kv_connectors.scheduler if kv_connectors else None,
    )
    if config.enable_lora:
        limit_lora_adapters(scheduler, config.max_loras)
    vocab_size = model.shape.vocab_size
    eos_ids = eos_token_ids(model_dir, hf_config)
    parts = EngineParts(
        model_dir=model_dir,
        architecture=architecture,
        tokenizer=tokenizer,
        device=device,
        dtype=settings.dtype,
        attention_backend=settings.attention_backend,
        weight_format=weight_format_summary(model),
        executor=executor,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        eos_token_ids=eos_ids,
        default_sampling=default_sampling,
        kv_cache_manager=kv_cache_manager,
        runner=runner,
        kv_connectors=kv_connectors,
        scheduler=scheduler,
        structured_output=StructuredOutputManager(
            tokenizer, vocab_size, eos_ids, config.structured_outputs_config
        ),
        lora_store=lora_store,
        kv_events=_kv_events(config, kv_cache_manager),
    )
    _log_start(parts, kv_spec, kv_cache_manager.num_blocks, config.block_size, kv_size_reason)
    return parts


def _runner(
    config: EngineConfig,
    model: LlamaForCausalLM,
    settings: LoadSettings,
    device: torch.device,
    executor: TensorParallelExecutor | None,
    kv_spec: KVCacheSpec,
    max_model_len: int,
    kv_groups: KVGroupLayout,
) -> tuple[ModelRunner, KVCacheManager, bool, str]:
    """The runner, over a KV cache sized for the target and the draft (if it keeps KV), and
    the manager of that cache's blocks; whether the draft keeps KV (proposals need slots);
    how the cache's size was chosen."""
    draft = None
    if config.speculative_config is not None:
        draft = load_draft(config, model, settings, device, max_model_len)
    # A draft model and an EAGLE layer keep KV in the paged pool; Medusa heads need none.
    draft_spec = (
        None
        if draft is None or isinstance(draft, MedusaHeads)
        else _kv_spec(config, draft, settings.dtype)
    )
    kv_size = kv_cache_size(config, kv_spec, max_model_len, device, draft_spec, kv_groups)
    hybrid = is_hybrid(model.architecture)
    if hybrid:  # the linear layers' state slots come out of the KV budget
        state_bytes = model.state_spec.bytes_per_slot * num_state_slots(config)
        kv_size = blocks_after_states(config, kv_size, kv_spec, state_bytes)
    num_blocks = kv_size.num_blocks
    swap_blocks = num_swap_blocks(config, kv_spec, num_blocks)
    kv_cache_manager = KVCacheManager(
        num_blocks,
        config.block_size,
        enable_caching=config.enable_prefix_caching,
        num_swap_blocks=swap_blocks,
        windows=kv_groups.windows,
    )
    proposer = make_proposer(config.speculative_config, draft, draft_spec, num_blocks, device)
    lora = (config.max_loras, config.max_lora_rank) if config.enable_lora else None
    spec = RunnerSpec(kv_spec, num_blocks, swap_blocks, config.seed, proposer, kv_groups, lora)
    runner = (executor.make_runner if executor else ModelRunner)(model, spec, device)
    if hybrid:
        attach_state_cache(config, runner, model, kv_cache_manager, device)
    if config.captures_decode(device) and not config.enable_lora:  # LoRA steps run eager
        runner.use_captured_decode(config.max_num_seqs, max_model_len)
    return runner, kv_cache_manager, draft_spec is not None, kv_size.reason


def _kv_connectors(
    config: EngineConfig,
    model_dir: Path,
    settings: LoadSettings,
    kv_spec: KVCacheSpec,
    kv_cache_manager: KVCacheManager,
) -> KVConnectorPair | None:
    """The configured KV connector's scheduler and worker halves."""
    if config.kv_transfer_config is None:
        return None
    dtype = str(settings.dtype)
    context = KVConnectorContext(
        kv_spec,
        model_fingerprint(model_dir, dtype, kv_spec),
        kv_cache_manager.block_hashes,
        transfer_fingerprint(model_dir, dtype, kv_spec),
    )
    return create_connector_pair(config.kv_transfer_config, context)


def _kv_events(config: EngineConfig, manager: KVCacheManager) -> ZmqEventPublisher | None:
    events = config.kv_events_config
    if events is None or not events.publishes:
        return None
    return ZmqEventPublisher(events, manager.publish_events())


def _scheduler(
    config: EngineConfig,
    runner: ModelRunner,
    kv_cache_manager: KVCacheManager,
    max_model_len: int,
    spec_lookahead: bool,
    kv_connector: KVConnectorBase | None,
) -> Scheduler:
    return Scheduler(
        kv_cache_manager,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
        policy=config.scheduling_policy,
        preemption_mode=config.preemption_mode,
        spec_policy=_speculation_policy(config.speculative_config),
        spec_lookahead=spec_lookahead,
        prefill_limits=_prefill_limits(config, runner, kv_cache_manager.num_blocks, max_model_len),
        kv_connector=kv_connector,
    )


def _lora(config: EngineConfig, runner: ModelRunner) -> LoRAAdapterStore | None:
    """With --enable-lora: the store the intake loads adapters into, checked against the
    shapes of the model the runner wrapped for adapters (its `RunnerSpec.lora`)."""
    manager = runner.lora
    if manager is None:
        return None
    max_cpu_loras = config.max_cpu_loras or config.max_loras
    return LoRAAdapterStore(manager.base_shapes, config.max_lora_rank, max_cpu_loras)


def _max_model_len(config: EngineConfig, model_max: int) -> int:
    """`config.max_model_len`, else the model's max_position_embeddings as in vLLM, but at
    most `DEFAULT_MAX_MODEL_LEN_CAP`: the RoPE tables and one sequence's KV cache are sized
    from it, and a config's claim (2^31 - 1 in a malformed file) must not size them."""
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = min(model_max, DEFAULT_MAX_MODEL_LEN_CAP)
        if model_max > DEFAULT_MAX_MODEL_LEN_CAP:
            logger.warning(
                "the model's max_position_embeddings=%d is more than tokenmill serves by "
                "default: max_model_len=%d; give --max-model-len to choose",
                model_max,
                max_model_len,
            )
    if max_model_len > model_max:
        raise ConfigError(
            f"max_model_len={max_model_len} is longer than the model's "
            f"max_position_embeddings={model_max}"
        )
    # Without chunking a prompt must fit one step's budget, or it would wait forever.
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"without chunked prefill, max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) must be >= max_model_len ({max_model_len}); "
            "raise it, lower max_model_len, or enable chunked prefill"
        )
    return max_model_len


def _kv_spec(
    config: EngineConfig, model: LlamaForCausalLM | EagleDraft | MtpDraft, dtype: torch.dtype
) -> KVCacheSpec:
    """Per rank: a tensor-parallel rank caches only its own KV heads."""
    return KVCacheSpec(
        num_layers=getattr(model, "num_kv_layers", model.shape.num_layers),  # hybrid: attention
        block_size=config.block_size,
        num_kv_heads=model.num_local_kv_heads,
        head_dim=model.shape.head_dim,
        dtype=config.kv_cache_torch_dtype(dtype),
    )


def _speculation_policy(spec: SpeculativeConfig | None) -> SpeculationPolicy | None:
    if spec is None:
        return None
    return SpeculationPolicy(spec.num_speculative_tokens, adaptive=spec.adaptive)


def _prefill_limits(
    config: EngineConfig, runner: ModelRunner, num_blocks: int, max_model_len: int
) -> PrefillLimits:
    """The prefill limits; with an ITL target, the cost model, warmed up by timing a few
    synthetic steps (the cache is still empty)."""
    limits = PrefillLimits(
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        max_num_partial_prefills=config.max_num_partial_prefills,
    )
    if config.itl_target_ms is None:
        return limits
    start = time.perf_counter()
    samples = calibrate(runner, num_blocks, config.max_num_seqs, max_model_len)
    limits.cost_model = StepCostModel.calibrated(samples)
    limits.itl_target = config.itl_target_ms / 1000
    logger.info(
        "ITL target %.0f ms: calibrated the step cost model in %.2f s (%d steps): %s",
        config.itl_target_ms,
        time.perf_counter() - start,
        len(samples),
        limits.cost_model.describe(),
    )
    return limits


def _default_sampling(config: EngineConfig, model_dir: Path) -> dict[str, Any]:
    """Sampling parameters a request gets for the fields it leaves unset."""
    source = config.generation_config
    if source == "vllm":
        return {}
    if source != "auto" and not (Path(source) / "generation_config.json").is_file():
        raise ConfigError(
            f"generation_config must be auto, vllm or a directory with a "
            f"generation_config.json; {source!r} has none"
        )
    defaults = sampling_defaults(model_dir if source == "auto" else source)
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as e:
        raise ConfigError(f"generation_config.json sets an invalid default: {e}") from e
    if defaults:
        logger.info("default sampling parameters from generation_config.json: %s", defaults)
    return defaults


def _log_start(
    parts: EngineParts, kv_spec: KVCacheSpec, num_blocks: int, block_size: int, kv_reason: str
) -> None:
    logger.info(
        "loaded %s (%s, %s on %s, attention %s, weights %s); KV cache (%s): %d blocks of "
        "%d tokens = %d tokens, %.2f GiB (%s); max concurrency at max_model_len=%d: %.1fx",
        parts.model_dir,
        parts.architecture,
        parts.dtype,
        parts.device,
        parts.attention_backend,
        parts.weight_format,
        kv_spec.dtype,
        num_blocks,
        block_size,
        num_blocks * block_size,
        num_blocks * kv_spec.bytes_per_block / 1024**3,
        kv_reason,
        parts.max_model_len,
        num_blocks * block_size / parts.max_model_len,
    )
