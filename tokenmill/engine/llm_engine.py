"""The step loop: schedule -> run -> apply -> outputs. Everything happens inside `step()`.

Its parts are built by `assembly.py`; requests come in through the intake (`intake.py`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.sched.output_applier import OutputApplier
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.engine.assembly import assemble
from tokenmill.engine.intake import EngineRequest, PromptType, RequestIntake, ResolvedRequest
from tokenmill.engine.kv_connectors import kv_transfer_stats, record_transfers, transfer_ring
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import EngineStats, KVBlockStates
from tokenmill.openmp import forget_openmp_wait_policy
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import InvalidRequestError, RequestOutputKind, SamplingParams
from tokenmill.spec_decode.proposer import Proposer
from tokenmill.step.request import Request, RequestStatus
from tokenmill.step.runner_output import ModelRunnerOutput
from tokenmill.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    import torch


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        forget_openmp_wait_policy()  # torch is loaded: child processes get the user's environment
        self.config = config
        self.parts = parts = assemble(config)  # what the engine runs, built once
        self.intake = RequestIntake(
            parts.tokenizer,
            parts.vocab_size,
            parts.max_model_len,
            parts.eos_token_ids,
            parts.structured_output,
            parts.kv_connectors.scheduler if parts.kv_connectors else None,
            parts.lora_store,
        )
        self.kv_transfers = transfer_ring(parts.kv_connectors)  # each request's, recently
        self.output_processor = OutputProcessor(parts.tokenizer)
        self.observer = parts.scheduler.observer  # feedback loops, counters, step records
        self.step_records = self.observer.step_records  # the last steps, for the dashboard
        self.output_applier = OutputApplier(parts.scheduler, self.output_processor.detokenize)

    # The parts read most often, from the engine's callers and tests; the rest: `self.parts`.

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.parts.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.parts.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.parts.max_model_len

    @property
    def attention_backend(self) -> str:
        """The attention backend resolved at start-up: torch, cpu or triton."""
        return self.parts.attention_backend

    @property
    def scheduler(self) -> Scheduler:
        return self.parts.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.parts.runner

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.parts.kv_cache_manager

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
        output_kind: RequestOutputKind | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request given as its fields (vLLM's `add_request` shape); `add` takes it
        as one `EngineRequest`."""
        self.add(
            EngineRequest(
                request_id,
                prompt,
                params,
                arrival_time,
                add_special_tokens,
                priority,
                cache_salt,
                output_kind,
                lora_request,
            )
        )

    def add(self, request: EngineRequest) -> None:
        """Queue a request. Raises `InvalidRequestError` for one the engine can't take
        (`RequestIntake.resolve` says what is checked). Its `params` is not written."""
        self.add_resolved(self.intake.resolve(request))

    def add_resolved(self, request: ResolvedRequest) -> None:
        """Queue a request the intake has checked: one scheduler request per sample."""
        if request.request_id in self.output_processor.requests or self.scheduler.has_request(
            request.request_id  # a finished request whose blocks a KV transfer still reads
        ):
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        sample_ids = self.output_processor.add_request(request)
        try:
            for sample_id, params in zip(sample_ids, request.sample_params(), strict=True):
                grammar = None
                if params.structured_outputs is not None:
                    grammar = self.parts.structured_output.request_grammar(params)
                self.scheduler.add_request(
                    Request(
                        sample_id,
                        request.prompt_token_ids,
                        params,
                        request.max_tokens,
                        request.arrival_time,
                        priority=request.priority,
                        cache_salt=request.cache_salt,
                        grammar=grammar,
                        lora=request.lora,
                    )
                )
        except Exception:  # none of it is queued then: the caller's error is the caller's alone
            self.abort_request(request.request_id)
            raise

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests in one pass over the scheduler's queues, however many there are
        (one pass per request made a client leaving with 60,000 prompts stall the engine)."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        sample_ids = [s for r in ids for s in self.output_processor.abort_request(r)]
        self.scheduler.finish_requests(sample_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def speculates(self) -> bool:
        """Whether this engine runs speculative decoding (and so has spec-decode stats)."""
        return self.observer.spec_stats is not None

    @property
    def num_steps(self) -> int:
        """Steps that scheduled tokens, since start."""
        return self.observer.num_steps

    @property
    def step_seconds(self) -> float:
        """Wall time inside those steps, since start."""
        return self.observer.step_seconds

    def use_proposer(self, proposer: Proposer) -> None:
        """Draft with a proposer of one's own (research, benchmarks: an oracle), in place of
        the configured one. The engine must speculate (`speculative_config`) and run on one
        rank; a proposer that needs KV of its own must bring it."""
        if not self.speculates:
            raise ConfigError("use_proposer needs an engine started with a speculative_config")
        if self.parts.executor is not None:
            raise ConfigError("use_proposer runs on one rank (tensor_parallel_size 1)")
        self.runner.use_proposer(proposer)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def refuse_kv_transfer_params(self, params: dict[str, Any]) -> None:
        """A request carrying `params` was refused before it was added: the KV connector
        lets go of what they point at (`KVConnectorBase.request_refused`)."""
        connectors = self.parts.kv_connectors
        if connectors is not None and isinstance(params, dict):
            connectors.scheduler.request_refused(params)

    def has_pending_kv_transfers(self) -> bool:
        """The KV connector still moves KV (a load on its way, blocks held for a send):
        the engine must keep stepping even when it has no request to run."""
        remote_kv = self.scheduler.remote_kv
        return remote_kv is not None and remote_kv.has_pending

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        self.scheduler.reset_prefix_cache()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        step_outputs = self.output_applier.finish_unrunnable()
        scheduler_output = self.scheduler.schedule()
        scheduler_output.grammar_bitmask = self.parts.structured_output.grammar_bitmask(
            self.scheduler.sampling_grammars(scheduler_output)
        )
        idle = scheduler_output.is_empty and not scheduler_output.finished_req_ids
        if idle and self.parts.kv_connectors is None:
            runner_output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            # Nothing could run: at most the requests whose grammar is compiling are waiting.
            self.parts.structured_output.wait_for_compiles(timeout=0.01)
        else:  # with a KV connector the runner also reports transfers in a step that idles
            run_start = time.perf_counter()
            runner_output = self.runner.execute_model(scheduler_output)
            self.observer.ran(time.perf_counter() - run_start, runner_output)
            record_transfers(self.kv_transfers, runner_output)
            if idle:
                self._wait_while_idle(runner_output)
        step_outputs += self.output_applier.update_from_output(scheduler_output, runner_output)
        outputs = self.output_processor.process_outputs(step_outputs)
        if self.parts.kv_events is not None:
            self.parts.kv_events.flush()
        self.observer.stepped(time.perf_counter() - start, runner_output, time.time())
        return outputs

    def _wait_while_idle(self, runner_output: ModelRunnerOutput) -> None:
        """A step that ran nothing: sleep until a transfer or a compile ends (or 10 ms)
        instead of spinning, unless the runner just reported transfers to act on."""
        transfers = runner_output.kv_connector_output
        if transfers is None or transfers.is_empty:
            connectors = self.parts.kv_connectors
            assert connectors is not None
            self.parts.structured_output.wait_for_compiles(timeout=0.005)
            connectors.worker.wait_for_transfers(timeout=0.01)

    def set_itl_target_ms(self, itl_target_ms: float) -> None:
        """Move the inter-token-latency target (the engine must have started with one): a
        benchmark sets it from the steady step it measured in this very engine."""
        self.scheduler.set_itl_target(itl_target_ms / 1000)

    def get_stats(self) -> EngineStats:
        return EngineStats(
            scheduler=self.scheduler.get_stats(),
            num_steps=self.observer.num_steps,
            num_prompt_tokens=self.observer.num_prompt_tokens_prefilled,
            num_generation_tokens=self.observer.num_generation_tokens,
            step_seconds=self.observer.step_seconds,
            forward_seconds=self.runner.forward_seconds,
            num_cached_prompt_tokens=self.observer.num_cached_prompt_tokens_prefilled,
            num_computed_prompt_tokens=self.observer.num_prompt_tokens_scheduled,
            kv_transfer=kv_transfer_stats(self.parts.kv_connectors),
        )

    # ---- for measurement (benchmarks/steps, benchmarks/peers, benchmarks/route_sim.py) -------

    @property
    def model(self) -> torch.nn.Module:
        """The loaded model (rank 0's shard): for measuring its weights and layers."""
        return self.runner.model

    @property
    def step_cost_coefficients(self) -> tuple[float, ...] | None:
        """The start-up calibration of the step cost model (with an ITL target), else None."""
        cost_model = self.scheduler.prefill_limits.cost_model
        return None if cost_model is None else tuple(cost_model.coefficients)

    def step_phases(self) -> list[tuple[str, object, str]]:
        """(phase, owner, method name) for each callable one step runs through, in order:
        a profiler wraps them to time a step by phase. Kept here, beside the parts, so that
        a renamed method changes this list and not the profilers."""
        return [
            ("schedule", self.scheduler, "schedule"),
            ("prepare", self.runner, "_prepare_inputs"),
            ("forward", self.runner, "_forward"),
            ("forward", self.runner.model, "compute_logits"),
            ("sample", self.runner, "_sample"),
            ("apply", self.output_applier, "update_from_output"),
            ("outputs", self.output_processor, "process_outputs"),
        ]

    def running_request_ids(self) -> set[str]:
        """The requests (as added, not their samples) the scheduler is running."""
        by_sample_id = self.output_processor.by_sample_id
        running = (by_sample_id.get(r.sample_id) for r in self.scheduler.running)
        return {entry[0].request_id for entry in running if entry is not None}

    def get_kv_block_states(self, max_cells: int) -> KVBlockStates:
        """Where the KV blocks are now, from O(1) counters: safe to call from another thread
        while the engine steps (the dashboard does, a few times a second)."""
        return self.kv_cache_manager.block_states(max_cells)

    # ---- lifecycle ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the grammar compiles, the KV connector and the tensor-parallel workers, if any
        (the workers are also stopped at garbage collection and exit)."""
        self.parts.structured_output.shutdown()
        if self.parts.kv_connectors is not None:
            self.parts.kv_connectors.shutdown()
        if self.parts.executor is not None:
            self.parts.executor.shutdown()
        if self.parts.kv_events is not None:
            self.parts.kv_events.close()

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """`SamplingParams` with the model's defaults, then `overrides`."""
        return SamplingParams(**{**self.parts.default_sampling, **overrides})
