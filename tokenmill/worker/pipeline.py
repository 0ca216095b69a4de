"""Pipeline parallelism's ranks: where a rank sits, its stage's groups, and a stage's runner.

World = tensor_parallel_size x pipeline_parallel_size ranks, numbered as vLLM numbers them:
rank = pp_rank * tp_size + tp_rank, so a stage's tensor-parallel ranks are consecutive and
rank 0 (the engine, with the scheduler) is the first stage's first. Every rank runs every
step's `SchedulerOutput` (broadcast as under tensor parallelism); a stage after the first
receives the previous stage's hidden states (point-to-point, rank (p-1, t) to (p, t)), a stage
before the last sends its own on, and the last stage samples. Its `ModelRunnerOutput` is
broadcast back to every rank: the engine reads it, and the other stages append the sampled
tokens to their copies of the requests (positions and block tables depend on them).

Micro-batches: a step's requests run in one run per stage (`micro_batch_count`), so that while
the last stage runs the first micro-batch the first stage runs the second (GPipe's schedule,
within one step; the scheduler stays one and synchronous). Requests do not read each other's
KV within a step, so any split gives the same tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.layers.kv_cache import swap_blocks
from tokenmill.layers.parallel import GroupSlot, TensorParallel
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.pipeline_split import PipelineStage
from tokenmill.step.runner_output import ModelRunnerOutput
from tokenmill.step.scheduler_output import SchedulerOutput
from tokenmill.worker.batch_inputs import BatchInputs
from tokenmill.worker.distributed import broadcast_object
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.runner_spec import RunnerSpec


@dataclass(frozen=True)
class RankPosition:
    """Where a global rank sits: its tensor-parallel rank within its pipeline stage."""

    rank: int
    tp_size: int = 1
    pp_size: int = 1

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def global_rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    @property
    def stage(self) -> PipelineStage:
        return PipelineStage(self.pp_rank, self.pp_size)

    def tensor_parallel(self) -> TensorParallel:
        """This rank's view of its stage's tensor parallelism. With one stage its collectives
        run on the default group; with several, on the stage's own (bound by `join_stages`)."""
        group = GroupSlot() if self.pp_size > 1 and self.tp_size > 1 else None
        return TensorParallel(rank=self.tp_rank, size=self.tp_size, group=group)


def join_stages(position: RankPosition, tp: TensorParallel, step_group: Any) -> StageLink | None:
    """After the default group is up: make each stage's tensor-parallel group (a collective:
    every rank makes every group, in order) and bind this rank's into `tp`; the link to the
    neighbouring stages (None without pipeline parallelism)."""
    if position.pp_size == 1:
        return None
    for pp_rank in range(position.pp_size):
        ranks = [position.global_rank(pp_rank, t) for t in range(position.tp_size)]
        group = dist.new_group(ranks, backend=dist.get_backend()) if position.tp_size > 1 else None
        if pp_rank == position.pp_rank and isinstance(tp.group, GroupSlot):
            tp.group.group = group
    return StageLink(position, step_group)


class StageLink:
    """A stage's hidden states to and from its neighbours; the last stage's output to all."""

    def __init__(self, position: RankPosition, step_group: Any) -> None:
        self.position = position
        self.stage = position.stage
        self.step_group = step_group
        pp, tp = position.pp_rank, position.tp_rank
        self.previous = position.global_rank(pp - 1, tp) if not self.stage.is_first else None
        self.next = position.global_rank(pp + 1, tp) if not self.stage.is_last else None
        self.output_source = position.global_rank(position.pp_size - 1, 0)

    def receive_hidden(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        assert self.previous is not None
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(hidden, self.previous)
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Sent asynchronously: (the send, the tensor it reads), to wait for before reuse."""
        assert self.next is not None
        hidden = hidden.contiguous()
        return dist.isend(hidden, self.next), hidden

    def share_output(self, output: ModelRunnerOutput | None) -> ModelRunnerOutput:
        """The last stage's output, on every rank (a collective over the step group)."""
        return broadcast_object(output, self.step_group, src=self.output_source)


class PipelineStageRunner(ModelRunner):
    """A rank's runner: a plain `ModelRunner` without pipeline parallelism (`link` None),
    else its stage's part of each step (see the module's docstring), in micro-batches."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        spec: RunnerSpec,
        device: torch.device,
        link: StageLink | None = None,
    ) -> None:
        if link is not None:  # the cache holds this stage's layers (the spec: the largest's)
            layers = len(model.stage_layers)
            spec = replace(spec, kv_cache_spec=replace(spec.kv_cache_spec, num_layers=layers))
        super().__init__(model, spec, device)
        self.link = link
        self.num_micro_batches = micro_batch_count(link.position.pp_size if link else 1)
        self._sends: list[tuple[Any, torch.Tensor]] = []  # this step's, until they complete

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        link = self.link
        if link is None:
            return super().execute_model(scheduler_output)
        swap_blocks(scheduler_output.blocks_to_swap_out, self.kv_tensors, self.swap_caches)
        swap_blocks(scheduler_output.blocks_to_swap_in, self.swap_caches, self.kv_tensors)
        self._update_states(scheduler_output)
        batches = self._micro_batches(scheduler_output)
        output = None
        if link.stage.is_last:
            output = merge_outputs([self._execute_batch(batch) for batch in batches])
        else:  # each micro-batch's hidden states go on while the next one runs here
            for batch in batches:
                self._forward(self._prepare_inputs(batch))
            for work, _ in self._sends:
                work.wait()
            self._sends.clear()
        output = link.share_output(output)
        if not link.stage.is_last:
            for req_id, token_ids in zip(output.req_ids, output.sampled_token_ids):
                self.requests[req_id].append(token_ids)
        return output

    def _micro_batches(self, scheduler_output: SchedulerOutput) -> list[SchedulerOutput]:
        """The step's requests in up to `num_micro_batches` runs of about equal tokens; one
        where a request wants logprobs (their rows are laid out for the whole step)."""
        if scheduler_output.is_empty:
            return []
        scheduled = list(scheduler_output.num_scheduled_tokens.items())
        count = min(self.num_micro_batches, len(scheduled))
        wants_logprobs = any(
            self.requests[req_id].sampling_params.logprobs is not None
            or self.requests[req_id].sampling_params.prompt_logprobs is not None
            for req_id, _ in scheduled
        )
        if count <= 1 or wants_logprobs:
            return [scheduler_output]
        share = scheduler_output.total_num_scheduled_tokens / count
        groups: list[dict[str, int]] = [{}]
        done = 0
        for req_id, num_tokens in scheduled:
            if groups[-1] and done >= share * len(groups) and len(groups) < count:
                groups.append({})
            groups[-1][req_id] = num_tokens
            done += num_tokens
        return [
            replace(
                scheduler_output,
                num_scheduled_tokens=group,
                total_num_scheduled_tokens=sum(group.values()),
            )
            for group in groups
        ]

    def _forward(self, inputs: BatchInputs) -> torch.Tensor:
        link = self.link
        if link is None:
            return super()._forward(inputs)
        assert inputs.metadata is not None  # pipeline stages run eager steps
        received = None
        if not link.stage.is_first:
            shape = self.model.shape
            received = link.receive_hidden(
                len(inputs.input_ids), shape.hidden_size, self.dtype, self.device
            )
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, received
        )
        if not link.stage.is_last:
            self._sends.append(link.send_hidden(hidden))
        return hidden

    @property
    def dtype(self) -> torch.dtype:
        """Of the hidden states between stages: the model's."""
        return self.model.stage_layers[0].input_layernorm.weight.dtype


def micro_batch_count(pp_size: int) -> int:
    """Micro-batches per step: one per stage, so that every stage has work while the others
    run theirs (`TOKENMILL_PP_MICRO_BATCHES` overrides, e.g. 1 for a step in one piece)."""
    return max(1, int(os.environ.get("TOKENMILL_PP_MICRO_BATCHES", pp_size)))


def merge_outputs(parts: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """The micro-batches' outputs as one step's (several only without logprobs)."""
    if len(parts) == 1:
        return parts[0]
    merged = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
    for part in parts:
        merged.req_ids.extend(part.req_ids)
        merged.sampled_token_ids.extend(part.sampled_token_ids)
    return merged
