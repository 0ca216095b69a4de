"""The step loop: schedule -> run -> update -> outputs. Everything happens inside `step()`."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from tokenmill.config import ConfigError, EngineConfig, SpeculativeConfig
from tokenmill.core.draft_length_policy import SpeculationPolicy
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.prefill_budget import PrefillLimits
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import ModelRunnerOutput
from tokenmill.core.step_cost import StepCostModel
from tokenmill.engine.kv_connectors import (
    KVConnectors,
    check_kv_transfer_params,
    kv_transfer_stats,
    make_kv_connectors,
    record_transfers,
    transfer_ring,
)
from tokenmill.engine.kv_sizing import num_kv_blocks, num_swap_blocks
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.step_records import StepRecord, new_step_ring
from tokenmill.layers.attention_backends import resolve_attention_backend
from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.layers.parallel import SINGLE
from tokenmill.metrics.stats import EngineStats, KVBlockStates
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import (
    checkpoint_dtype,
    eos_token_ids,
    load_hf_config,
    load_model,
    load_tokenizer,
    sampling_defaults,
)
from tokenmill.openmp import forget_openmp_wait_policy
from tokenmill.outputs import RequestOutput
from tokenmill.quantization.selection import weight_format_summary
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import InvalidRequestError, SamplingParams
from tokenmill.spec_decode.draft_model import DraftModelProposer
from tokenmill.spec_decode.eagle import EagleDraft, EagleProposer
from tokenmill.spec_decode.head_checkpoint import load_eagle, load_medusa
from tokenmill.spec_decode.medusa import MedusaHeads, MedusaProposer
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.proposer import Proposer
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.request_grammar import RequestGrammar
from tokenmill.worker.calibration import calibrate
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.tp_executor import TensorParallelExecutor

logger = logging.getLogger(__name__)

PromptType = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        forget_openmp_wait_policy()  # torch is loaded: child processes get the user's environment
        self.config = config
        if config.model is None:
            raise ConfigError("no model given: set EngineConfig.model to a checkpoint directory")
        model_dir = Path(config.model)
        self.model_dir = model_dir
        self.hf_config, self.architecture = load_hf_config(model_dir)
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(config.tokenizer or model_dir)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(checkpoint_dtype(self.hf_config))
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        torch.manual_seed(config.seed)
        # Tensor parallelism: this process is rank 0; the executor starts ranks 1..N-1.
        self.executor = TensorParallelExecutor(config) if config.tensor_parallel_size > 1 else None
        model = self._load_target()
        self.weight_format = weight_format_summary(model)  # /v1/models, the start-up log
        self.max_model_len = self._resolve_max_model_len(model.shape.max_position)
        self.vocab_size = model.shape.vocab_size
        self.eos_token_ids = eos_token_ids(model_dir, self.hf_config)
        self.default_sampling = self._default_sampling()
        kv_spec = self._kv_spec(model)
        spec = config.speculative_config
        draft = self._load_draft_model(model, spec) if spec is not None else None
        # A draft model and an EAGLE layer keep KV in the paged pool; Medusa heads need none.
        draft_spec = (
            None if draft is None or isinstance(draft, MedusaHeads) else self._kv_spec(draft)
        )
        num_blocks = num_kv_blocks(config, kv_spec, self.max_model_len, self.device, draft_spec)
        swap_blocks = num_swap_blocks(config, kv_spec, num_blocks)
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            num_swap_blocks=swap_blocks,
        )
        proposer = self._proposer(draft, draft_spec, num_blocks)
        self.runner = (self.executor.make_runner if self.executor else ModelRunner)(
            model,
            kv_spec,
            num_blocks,
            self.device,
            seed=config.seed,
            num_swap_blocks=swap_blocks,
            proposer=proposer,
        )
        if config.captures_decode(self.device):
            self.runner.use_captured_decode(config.max_num_seqs, self.max_model_len)
        self.kv_connectors = self._kv_connectors(kv_spec)
        self.kv_transfers = transfer_ring(self.kv_connectors)  # each request's, recently
        self.scheduler = self._scheduler(num_blocks, spec_lookahead=draft_spec is not None)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.vocab_size, self.eos_token_ids, config.structured_outputs_config
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.num_steps = 0
        self.num_generation_tokens = 0
        self.step_seconds = 0.0  # wall time inside step() since start
        self.step_records = new_step_ring()  # the last steps, for the dashboard
        self._log_start(kv_spec, num_blocks)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Raises `InvalidRequestError` for a prompt the engine can't take.

        `add_special_tokens=False` is for text that already carries them, such as a rendered
        chat template (which starts with BOS itself).
        """
        if request_id in self.output_processor.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if isinstance(params.structured_outputs, StructuredOutputsParams):
            self.structured_output.validate(params.structured_outputs)
        check_kv_transfer_params(self.kv_connectors, params)
        prompt_text, prompt_token_ids = self._tokenize(prompt, add_special_tokens)
        self._validate_prompt(prompt_token_ids)
        _validate_cache_salt(cache_salt)
        self._validate_token_ids(params)
        params = params.clone()
        params.all_stop_token_ids = set(self.eos_token_ids)
        arrival_time = time.time() if arrival_time is None else arrival_time
        max_tokens = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        child_ids = self.output_processor.add_request(
            request_id, prompt_text, prompt_token_ids, params, arrival_time
        )
        try:
            for index, child_id in enumerate(child_ids):
                child_params = _child_params(params, index)
                self.scheduler.add_request(
                    Request(
                        child_id,
                        prompt_token_ids,
                        child_params,
                        max_tokens,
                        arrival_time,
                        priority=priority,
                        cache_salt=cache_salt,
                        grammar=self._request_grammar(child_params),
                    )
                )
        except Exception:  # none of it is queued then: the caller's error is the caller's alone
            self.abort_request(request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests in one pass over the scheduler's queues, however many there are
        (one pass per request made a client leaving with 60,000 prompts stall the engine)."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        child_ids = [c for r in ids for c in self.output_processor.abort_request(r)]
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def speculates(self) -> bool:
        """Whether this engine runs speculative decoding (and so has spec-decode stats)."""
        return self.scheduler.spec_stats is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        self.scheduler.reset_prefix_cache()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        core_outputs = self.scheduler.finish_without_output()
        num_prompt_tokens_before = self.scheduler.num_prompt_tokens_scheduled
        scheduler_output = self.scheduler.schedule()
        scheduler_output.grammar_bitmask = self.structured_output.grammar_bitmask(
            self.scheduler.requests, scheduler_output
        )
        idle = scheduler_output.is_empty and not scheduler_output.finished_req_ids
        if idle and self.kv_connectors is None:
            runner_output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            # Nothing could run: at most the requests whose grammar is compiling are waiting.
            self.structured_output.wait_for_compiles(timeout=0.01)
        else:  # with a KV connector the runner also reports transfers in a step that idles
            run_start = time.perf_counter()
            runner_output = self.runner.execute_model(scheduler_output)
            self.scheduler.observe_step_time(time.perf_counter() - run_start, runner_output)
            record_transfers(self.kv_transfers, runner_output)
            if idle and self.kv_connectors is not None:
                self._wait_while_idle(runner_output)
        core_outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        if not scheduler_output.is_empty:
            self.num_steps += 1
            seconds = time.perf_counter() - start
            self.step_seconds += seconds
            self.scheduler.observe_step_cost(seconds)
            num_prefill = self.scheduler.num_prompt_tokens_scheduled - num_prompt_tokens_before
            self.step_records.append(
                StepRecord(
                    time.time(),
                    seconds,
                    num_prefill,
                    scheduler_output.total_num_scheduled_tokens - num_prefill,
                    len(scheduler_output.num_scheduled_tokens),
                    scheduler_output.num_spec_tokens_to_propose,
                    len(scheduler_output.preempted_req_ids),
                )
            )
        self.num_generation_tokens += sum(len(t) for t in runner_output.sampled_token_ids)
        return outputs

    def _wait_while_idle(self, runner_output: ModelRunnerOutput) -> None:
        """A step that ran nothing: sleep until a transfer or a compile ends (or 10 ms)
        instead of spinning, unless the runner just reported transfers to act on."""
        transfers = runner_output.kv_connector_output
        if transfers is None or transfers.is_empty:
            assert self.kv_connectors is not None
            self.structured_output.wait_for_compiles(timeout=0.005)
            self.kv_connectors[1].wait_for_transfers(timeout=0.01)

    def has_pending_kv_transfers(self) -> bool:
        """The KV connector still moves KV (a load on its way, blocks held for a send):
        the engine must keep stepping even when it has no request to run."""
        return self.scheduler.has_pending_kv_transfers()

    def set_itl_target_ms(self, itl_target_ms: float) -> None:
        """Move the inter-token-latency target (the engine must have started with one): a
        benchmark sets it from the steady step it measured in this very engine."""
        self.scheduler.set_itl_target(itl_target_ms / 1000)

    def get_stats(self) -> EngineStats:
        return EngineStats(
            scheduler=self.scheduler.get_stats(),
            num_steps=self.num_steps,
            num_prompt_tokens=self.scheduler.num_prompt_tokens_prefilled,
            num_generation_tokens=self.num_generation_tokens,
            step_seconds=self.step_seconds,
            forward_seconds=self.runner.forward_seconds,
            num_cached_prompt_tokens=self.scheduler.num_cached_prompt_tokens_prefilled,
            num_computed_prompt_tokens=self.scheduler.num_prompt_tokens_scheduled,
            kv_transfer=kv_transfer_stats(self.kv_connectors),
        )

    def running_request_ids(self) -> set[str]:
        """The requests (as added, not their samples) the scheduler is running."""
        samples = self.output_processor.child_to_sample
        return {
            samples[r.request_id][0].request_id
            for r in self.scheduler.running
            if r.request_id in samples
        }

    def get_kv_block_states(self, max_cells: int) -> KVBlockStates:
        """Where the KV blocks are now, from O(1) counters: safe to call from another thread
        while the engine steps (the dashboard does, a few times a second)."""
        return self.kv_cache_manager.block_states(max_cells)

    # ---- helpers -----------------------------------------------------------------------------

    def _tokenize(
        self, prompt: PromptType, add_special_tokens: bool
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("prompt", "must be a string or a list of token ids")

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {len(token_ids)} tokens, more than this model's maximum context length "
                f"(max_model_len={self.max_model_len})",
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )

    def shutdown(self) -> None:
        """Stop the grammar compiles, the KV connector and the tensor-parallel workers, if any
        (the workers are also stopped at garbage collection and exit)."""
        self.structured_output.shutdown()
        for connector in self.kv_connectors or ():
            connector.shutdown()
        if self.executor is not None:
            self.executor.shutdown()

    def _load_target(self) -> LlamaForCausalLM:
        """The target model; under tensor parallelism this rank's shard of it."""
        return load_model(
            self.model_dir,
            self.hf_config,
            self.architecture,
            self.dtype,
            self.device,
            self.config.linear_backend_for(self.device),
            self.attention_backend,
            tp=self.executor.tp if self.executor else SINGLE,
            quantization=self.config.quantization,
        )

    def _scheduler(self, num_blocks: int, spec_lookahead: bool) -> Scheduler:
        config = self.config
        return Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
            preemption_mode=config.preemption_mode,
            spec_policy=self._speculation_policy(),
            spec_lookahead=spec_lookahead,
            prefill_limits=self._prefill_limits(num_blocks),
            kv_connector=self.kv_connectors[0] if self.kv_connectors else None,
        )

    def _kv_connectors(self, kv_spec: KVCacheSpec) -> KVConnectors | None:
        """The KV connector's scheduler and worker halves, if configured; the runner gets its."""
        connectors = make_kv_connectors(
            self.config.kv_transfer_config,
            self.model_dir,
            str(self.dtype),
            kv_spec,
            self.kv_cache_manager.block_hashes,
        )
        if connectors is not None:
            self.runner.use_kv_connector(connectors[1])
        return connectors

    def _log_start(self, kv_spec: KVCacheSpec, num_blocks: int) -> None:
        block_size = self.config.block_size
        logger.info(
            "loaded %s (%s, %s on %s, attention %s, weights %s); KV cache (%s): %d blocks of "
            "%d tokens = %d tokens, %.1f GiB; max concurrency at max_model_len=%d: %.1fx",
            self.model_dir,
            self.architecture,
            self.dtype,
            self.device,
            self.attention_backend,
            self.weight_format,
            kv_spec.dtype,
            num_blocks,
            block_size,
            num_blocks * block_size,
            num_blocks * kv_spec.bytes_per_block / 1024**3,
            self.max_model_len,
            num_blocks * block_size / self.max_model_len,
        )

    def _kv_spec(self, model: LlamaForCausalLM | EagleDraft) -> KVCacheSpec:
        """Per rank: a tensor-parallel rank caches only its own KV heads."""
        return KVCacheSpec(
            num_layers=model.shape.num_layers,
            block_size=self.config.block_size,
            num_kv_heads=model.num_local_kv_heads,
            head_dim=model.shape.head_dim,
            dtype=self.config.kv_cache_torch_dtype(self.dtype),
        )

    def _load_draft_model(
        self, target: LlamaForCausalLM, spec: SpeculativeConfig
    ) -> LlamaForCausalLM | EagleDraft | MedusaHeads | None:
        if spec.method == "ngram":
            return None
        draft_dir = spec.model
        if draft_dir is None:
            raise ConfigError(
                f"speculative_config method {spec.method} needs a model path (only the "
                "built-in demo target has a default draft and heads)"
            )
        if spec.method == "eagle":
            return load_eagle(draft_dir, target, self.dtype, self.device, spec.draft_weights)
        if spec.method == "medusa":
            return load_medusa(draft_dir, target, self.dtype, self.device)
        hf_config, architecture = load_hf_config(draft_dir)
        draft = load_model(
            draft_dir,
            hf_config,
            architecture,
            self.dtype,
            self.device,
            self.config.linear_backend,
            self.config.attention_backend,
        )
        if draft.shape.vocab_size != target.shape.vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary ({draft.shape.vocab_size}) differs from the "
                f"target's ({target.shape.vocab_size}); they must share a tokenizer"
            )
        if draft.shape.max_position < self.max_model_len:
            raise ConfigError(
                f"the draft model's max_position_embeddings ({draft.shape.max_position}) is "
                f"shorter than max_model_len={self.max_model_len}"
            )
        return draft

    def _default_sampling(self) -> dict[str, float]:
        """Sampling parameters a request gets for the fields it leaves unset."""
        source = self.config.generation_config
        if source == "vllm":
            return {}
        if source != "auto" and not (Path(source) / "generation_config.json").is_file():
            raise ConfigError(
                f"generation_config must be auto, vllm or a directory with a "
                f"generation_config.json; {source!r} has none"
            )
        defaults = sampling_defaults(self.model_dir if source == "auto" else source)
        try:
            SamplingParams(**defaults)
        except InvalidRequestError as e:
            raise ConfigError(f"generation_config.json sets an invalid default: {e}") from e
        if defaults:
            logger.info("default sampling parameters from generation_config.json: %s", defaults)
        return defaults

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """`SamplingParams` with the model's defaults, then `overrides`."""
        return SamplingParams(**{**self.default_sampling, **overrides})

    def _speculation_policy(self) -> SpeculationPolicy | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        return SpeculationPolicy(spec.num_speculative_tokens, adaptive=spec.adaptive)

    def _prefill_limits(self, num_blocks: int) -> PrefillLimits:
        """The prefill limits; with an ITL target, the cost model, warmed up by timing a few
        synthetic steps (the cache is still empty)."""
        config = self.config
        limits = PrefillLimits(
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_num_partial_prefills=config.max_num_partial_prefills,
        )
        if config.itl_target_ms is None:
            return limits
        start = time.perf_counter()
        samples = calibrate(self.runner, num_blocks, config.max_num_seqs, self.max_model_len)
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

    def _proposer(
        self,
        draft: LlamaForCausalLM | EagleDraft | MedusaHeads | None,
        draft_spec: KVCacheSpec | None,
        num_blocks: int,
    ) -> Proposer | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        if isinstance(draft, MedusaHeads):
            return MedusaProposer(draft)
        if isinstance(draft, EagleDraft) and draft_spec is not None:
            return EagleProposer(draft, draft_spec, num_blocks, self.device)
        if draft is not None and draft_spec is not None:
            return DraftModelProposer(draft, draft_spec, num_blocks, self.device)
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _request_grammar(self, params: SamplingParams) -> RequestGrammar | None:
        if params.structured_outputs is None:
            return None
        return self.structured_output.request_grammar(params)

    def _validate_token_ids(self, params: SamplingParams) -> None:
        for field, ids in (
            ("logit_bias", list(params.logit_bias or {})),
            ("stop_token_ids", params.stop_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    field, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )

    def _resolve_max_model_len(self, model_max: int) -> int:
        config = self.config
        max_model_len = model_max if config.max_model_len is None else config.max_model_len
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


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of a request with `n` samples: one sample, its own seed."""
    if params.n == 1:
        return params
    child_params = params.clone()
    child_params.n = 1
    if params.seed is not None:
        child_params.seed = params.seed + index
    return child_params


def _validate_cache_salt(cache_salt: str | None) -> None:
    """As vLLM: a salt, if given, is a non-empty string; it must also be valid Unicode, since
    the prefix cache hashes its UTF-8 bytes (a lone surrogate would fail the engine step)."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError("cache_salt", "must be a non-empty string if provided")
    try:
        cache_salt.encode()
    except UnicodeEncodeError:
        raise InvalidRequestError("cache_salt", "must be valid Unicode text") from None
