"""SchedulerOutput -> flat tensors -> forward -> sampled tokens. No scheduling decisions here."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tokenmill.kv_transfer.base import KVConnectorBase
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.kv_cache import swap_blocks
from tokenmill.layers.linear_state import LinearStateCache
from tokenmill.layers.sampler import (
    Sampler,
    SamplingMetadata,
    greedy_tokens,
    takes_argmax,
)
from tokenmill.lora.model_manager import LoRAModelManager
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.proposer import (
    HiddenStateProposer,
    Proposer,
    RequestTrackingProposer,
    threads_for,
)
from tokenmill.spec_decode.verification import accept, verify
from tokenmill.step.layout import attention_group_key, layout_decode, layout_step, to_device
from tokenmill.step.runner_output import ModelRunnerOutput
from tokenmill.step.runner_request_state import CachedRequestState
from tokenmill.step.scheduler_output import SchedulerOutput
from tokenmill.worker.batch_inputs import (
    BatchInputs,
    all_decode,
    apply_grammar,
    captured_inputs,
    decode_inputs,
    verify_inputs,
)
from tokenmill.worker.captured_step import (
    Capture,
    CapturedDecodeStep,
    DecodeBatch,
    build_decode_step,
)
from tokenmill.worker.prompt_logprobs import prompt_logprob_rows, prompt_logprobs
from tokenmill.worker.runner_spec import RunnerSpec


class ModelRunner:
    kv_connector: KVConnectorBase | None = None  # the worker half of a KV connector
    lora: LoRAModelManager | None = None  # LoRA adapters' slots and per-step rows
    # A hybrid model's linear-attention states: a slot per running sequence.
    linear_states: LinearStateCache | None = None

    def __init__(self, model: LlamaForCausalLM, spec: RunnerSpec, device: torch.device) -> None:
        kv_cache_spec, num_kv_blocks, num_swap_blocks = (
            spec.kv_cache_spec,
            spec.num_kv_blocks,
            spec.num_swap_blocks,
        )
        self.model = model
        self.block_size = kv_cache_spec.block_size
        self.device = device
        self.sliding_window = model.shape.sliding_window
        # One block past the scheduler's: the scratch block padded rows of a captured decode
        # step write to.
        self.kv_tensors = kv_cache_spec.allocate(num_kv_blocks + 1, device)
        # A hybrid model's layers share `width` tensors, each layer through its group's table.
        self.kv_groups = spec.kv_groups if spec.kv_groups and spec.kv_groups.hybrid else None
        self.kv_caches = self.kv_tensors
        if self.kv_groups is not None:
            self.kv_caches = [self.kv_tensors[t] for t in self.kv_groups.layer_tensor]
            model.kv_layer_groups = self.kv_groups.layer_group
        self.scratch_block = num_kv_blocks
        self.decode_step: CapturedDecodeStep | None = None
        # The swap pool lives in host memory (pinned, so copies to a GPU run asynchronously).
        pin = device.type == "cuda"
        self.swap_caches = (
            kv_cache_spec.allocate(num_swap_blocks, torch.device("cpu"), pin=pin)
            if num_swap_blocks
            else []
        )
        generator = torch.Generator(device=device)
        generator.manual_seed(spec.seed)
        self.sampler = Sampler(generator=generator)
        self.requests: dict[str, CachedRequestState] = {}
        self.forward_seconds = 0.0  # in the model's forward and logits, since start
        self.use_proposer(spec.proposer)
        if spec.lora is not None:  # every tensor-parallel rank wraps its shard the same way
            self.use_lora(LoRAModelManager(model, *spec.lora))

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        swap_blocks(scheduler_output.blocks_to_swap_out, self.kv_tensors, self.swap_caches)
        swap_blocks(scheduler_output.blocks_to_swap_in, self.swap_caches, self.kv_tensors)
        self._update_states(scheduler_output)
        connector = self.kv_connector
        if connector is not None:  # also in a step that runs nothing: transfers go on
            self._start_kv_load(connector, scheduler_output)
        if scheduler_output.is_empty:
            return self._with_kv_transfers(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        return self._with_kv_transfers(self._execute_batch(scheduler_output))

    def _execute_batch(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Forward, logits and sampling of the scheduled requests (a pipeline's last stage runs
        it once per micro-batch: worker/pipeline.py)."""
        connector = self.kv_connector
        inputs = self._prepare_inputs(scheduler_output)
        if self.lora is not None:
            self.lora.prepare_step(inputs.states, inputs.row_starts, len(inputs.input_ids))
        start = time.perf_counter()
        hidden = self._forward(inputs)
        rows = inputs.logits_indices
        logits = self.model.compute_logits(
            hidden[: len(inputs.sampling_states)] if rows is None else hidden[rows]
        )
        self._synchronize()
        self.forward_seconds += time.perf_counter() - start
        if connector is not None:
            connector.wait_for_save()
        output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if inputs.sampling_states:
            if scheduler_output.grammar_bitmask is not None:
                apply_grammar(logits, scheduler_output.grammar_bitmask, inputs)
            output = self._sample(logits, inputs.sampling_states, inputs.sampling_drafts)
            if self.linear_states is not None and any(inputs.sampling_drafts):
                self.linear_states.accept(
                    {r: len(t) - 1 for r, t in zip(output.req_ids, output.sampled_token_ids)}
                )
            if self.hidden_consumer is not None:
                self._record_hidden_states(self.hidden_consumer, hidden, inputs, output)
            num_drafts = scheduler_output.num_spec_tokens_to_propose
            if self.proposer is not None and num_drafts > 0:
                propose_start = time.perf_counter()
                with threads_for(self.proposer):
                    output.spec_token_ids = self.proposer.propose(
                        inputs.sampling_states, num_drafts
                    )
                self._synchronize()
                output.propose_seconds = time.perf_counter() - propose_start
        if inputs.prompt_logprob_rows:
            output.prompt_logprobs = prompt_logprobs(
                self.model, hidden, inputs.prompt_logprob_rows, self.device
            )
        return output

    def _with_kv_transfers(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """The step is done with the connector's metadata; what its transfers did since."""
        if self.kv_connector is not None:
            self.kv_connector.clear_connector_metadata()
            output.kv_connector_output = self.kv_connector.get_finished()
        return output

    def use_proposer(self, proposer: Proposer | None) -> None:
        """Draft with `proposer` (speculative decoding: n-gram, draft model, EAGLE, Medusa);
        one drafting from the target's hidden states gets them after every step."""
        self.proposer = proposer
        self.hidden_consumer = proposer if isinstance(proposer, HiddenStateProposer) else None
        self.request_tracker = proposer if isinstance(proposer, RequestTrackingProposer) else None

    def use_lora(self, manager: LoRAModelManager) -> None:
        """Run each request's LoRA adapter (the model's linears wrapped by `manager`)."""
        self.lora = manager

    def use_linear_states(self, cache: LinearStateCache) -> None:
        """Hold a hybrid model's per-sequence states: a slot taken when a sequence is
        admitted, given back when it finishes or is preempted (layers/linear_state.py)."""
        self.linear_states = cache

    def use_kv_connector(self, connector: KVConnectorBase) -> None:
        """Load and save KV blocks around each step's forward through `connector`."""
        connector.register_kv_caches(self.kv_caches)
        self.kv_connector = connector

    @staticmethod
    def _start_kv_load(connector: KVConnectorBase, scheduler_output: SchedulerOutput) -> None:
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        connector.start_load_kv()

    def use_captured_decode(
        self,
        max_num_seqs: int,
        max_model_len: int,
        capture: Capture | None = None,
        compile_backend: str = "inductor",
    ) -> None:
        """Run decode-only steps through captured steps: CUDA graphs on a GPU, a compiled
        forward on the CPU, or `capture` (`worker/captured_step.py`)."""
        windows = {w for w in self.model.traits.layer_windows or () if w is not None}
        self.decode_step = build_decode_step(
            lambda ids, positions, metadata: self.model(ids, positions, self.kv_caches, metadata),
            self.device,
            max_num_seqs,
            -(-max_model_len // self.block_size),
            self.block_size,
            self.scratch_block,
            self.sliding_window,
            capture,
            compile_backend,
            len(self.kv_groups.windows) if self.kv_groups else 1,
            sorted(windows),
        )

    def _forward(self, inputs: BatchInputs) -> torch.Tensor:
        if inputs.decode is not None:
            assert self.decode_step is not None
            return self.decode_step.run(inputs.decode)
        assert inputs.metadata is not None
        if self.linear_states is not None:
            states = inputs.states
            self.linear_states.prepare(
                [s.req_id for s in states],
                inputs.row_starts,
                len(inputs.input_ids),
                inputs.first_positions,
                inputs.known_ends,
                [s.block_ids for s in states],
            )
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        if self.request_tracker is not None:
            self.request_tracker.release(
                scheduler_output.finished_req_ids, scheduler_output.preempted_req_ids
            )
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.requests.pop(req_id, None)
            if self.linear_states is not None:
                self.linear_states.release(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                lora=new.lora,
            )
            if self.linear_states is not None:  # a prefix hit starts from its snapshot
                self.linear_states.admit(new.req_id, new.num_computed_tokens, new.block_ids)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id, tables in scheduler_output.kv_group_block_ids.items():
            state = self.requests[req_id]
            if not state.group_block_ids:
                state.group_block_ids = [[] for _ in tables]
            for table, new_ids in zip(state.group_block_ids, tables, strict=True):
                table.extend(new_ids)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> BatchInputs:
        num_scheduled = scheduler_output.num_scheduled_tokens
        spec_tokens = scheduler_output.scheduled_spec_tokens
        # Ordered by attention group, so each group is one run of rows.
        states = sorted(
            (self.requests[req_id] for req_id in num_scheduled),
            key=lambda s: attention_group_key(
                num_scheduled[s.req_id], s.num_computed_tokens + num_scheduled[s.req_id]
            ),
        )
        if self.decode_step is None and not spec_tokens and all_decode(states, num_scheduled):
            inputs = decode_inputs(states, self.block_size, self.sliding_window, self.device)
            assert inputs.metadata is not None
            seq_lens = [len(s.token_ids) for s in states]
            self._group_metadata(inputs.metadata, states, lambda ids: layout_decode(
                ids, seq_lens, self.block_size, self.sliding_window, self.device
            ))  # fmt: skip
            return inputs
        drafts = [spec_tokens.get(s.req_id, []) for s in states]
        if (inputs := verify_inputs(self, states, num_scheduled, drafts)) is not None:
            return inputs
        query_lens = np.array([num_scheduled[s.req_id] for s in states], dtype=np.int64)
        computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        seq_lens = computed + query_lens
        ends = np.cumsum(query_lens)
        starts = ends - query_lens
        # Known tokens (the last verified one, or a prompt chunk), then the drafts to verify.
        known_ends = [int(e) - len(d) for e, d in zip(seq_lens, drafts)]
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                itertools.chain(s.token_ids[c:e], d)
                for s, c, e, d in zip(states, computed, known_ends, drafts)
            ),
            dtype=np.int64,
            count=int(ends[-1]),
        )
        decode = self._captured_decode(states, input_ids, query_lens, seq_lens)
        if decode is not None:
            return captured_inputs(decode, states, computed, known_ends, self.device)
        positions, metadata = layout_step(
            [s.block_ids for s in states],
            query_lens,
            seq_lens,
            self.block_size,
            self.sliding_window,
            self.device,
        )
        self._group_metadata(metadata, states, lambda ids: layout_step(
            ids, query_lens, seq_lens, self.block_size, self.sliding_window, self.device
        ))  # fmt: skip
        samples = [e == len(s.token_ids) for s, e in zip(states, known_ends)]
        logits_indices = [
            index
            for end, d, sample in zip(ends, drafts, samples)
            if sample
            for index in range(int(end) - 1 - len(d), int(end))
        ]
        return BatchInputs(
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            metadata=metadata,
            logits_indices=self._to_device(np.array(logits_indices, dtype=np.int64)),
            sampling_states=[s for s, sample in zip(states, samples) if sample],
            sampling_drafts=[d for d, sample in zip(drafts, samples) if sample],
            prompt_logprob_rows=prompt_logprob_rows(states, computed, seq_lens, starts),
            states=states,
            row_starts=starts.tolist(),
            first_positions=computed.tolist(),
            known_ends=known_ends,
        )

    def _group_metadata(
        self,
        metadata: AttentionMetadata,
        states: list[CachedRequestState],
        layout: Callable[[list[list[int]]], tuple[np.ndarray, AttentionMetadata]],
    ) -> None:
        """The other KV groups' metadata of a hybrid model's step: the same tokens through
        each group's block tables."""
        if self.kv_groups is None:
            return
        metadata.kv_groups = [
            layout([s.group_block_ids[group] for s in states])[1]
            for group in range(len(self.kv_groups.windows) - 1)
        ]

    def _captured_decode(
        self,
        states: list[CachedRequestState],
        input_ids: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
    ) -> DecodeBatch | None:
        """The key of a step the captured decode step can run: every request decodes one
        token and samples it, without prompt logprobs; else None."""
        if self.decode_step is None or int(query_lens.max()) != 1:
            return None
        if any(
            len(s.token_ids) != n or s.sampling_params.prompt_logprobs is not None
            for s, n in zip(states, seq_lens)
        ):
            return None
        key = self.decode_step.key_for(seq_lens)
        if key is None:
            return None
        groups = (
            [[s.group_block_ids[g] for s in states] for g in range(len(self.kv_groups.windows) - 1)]
            if self.kv_groups
            else []
        )
        return DecodeBatch(key, input_ids, [s.block_ids for s in states], seq_lens, groups)

    @staticmethod
    def _record_hidden_states(
        consumer: HiddenStateProposer,
        hidden: torch.Tensor,
        inputs: BatchInputs,
        output: ModelRunnerOutput,
    ) -> None:
        """Hand the proposer the hidden states of each request's verified tokens: its known
        tokens and the drafts it accepted (the rows of rejected drafts are left out)."""
        accepted = {r: len(t) - 1 for r, t in zip(output.req_ids, output.sampled_token_ids)}
        if inputs.decode is not None:  # a captured step's output buffer is reused: copy
            hidden = hidden[: len(inputs.states)].clone()
        for state, start, first, known_end in zip(
            inputs.states,
            inputs.row_starts,
            inputs.first_positions,
            inputs.known_ends,
        ):
            count = known_end - first + accepted.get(state.req_id, 0)
            consumer.record_hidden_states(state, first, hidden[start : start + count])

    def _sample(
        self,
        logits: torch.Tensor,
        states: list[CachedRequestState],
        drafts: list[list[int]],
    ) -> ModelRunnerOutput:
        """One token per request, or, for requests with drafts, the verified drafts plus one:
        row j of such a request is sampled as if drafts[:j] were already output."""
        if all(
            takes_argmax(s.sampling_params, len(s.token_ids) - s.num_prompt_tokens) for s in states
        ):  # (a row after j drafts has more output: it takes the argmax too)
            token_ids = accept(greedy_tokens(logits), drafts)[0]
            for state, ids in zip(states, token_ids):
                state.append(ids)
            return ModelRunnerOutput(
                req_ids=[s.req_id for s in states], sampled_token_ids=token_ids
            )
        params: list[SamplingParams] = []
        prompts: list[Sequence[int]] = []
        outputs: list[Sequence[int]] = []
        for state, request_drafts in zip(states, drafts):
            # Only penalties read the token history; other rows need just the output length,
            # so copying a long prompt every step is avoided.
            history = state.sampling_params.needs_penalties
            prompt = state.prompt_token_ids if history else ()
            output_ids = state.output_token_ids if history else None
            num_output = len(state.token_ids) - state.num_prompt_tokens
            for j in range(len(request_drafts) + 1):
                params.append(state.sampling_params)
                prompts.append(prompt)
                if output_ids is None:
                    outputs.append(range(num_output + j))
                else:
                    outputs.append(output_ids + request_drafts[:j])
        metadata = SamplingMetadata.build(params, prompts, outputs, self.device, logits.shape[-1])
        verified = verify(self.sampler, logits, metadata, drafts)
        for state, token_ids in zip(states, verified.token_ids):
            state.append(token_ids)
        output = ModelRunnerOutput(
            req_ids=[s.req_id for s in states], sampled_token_ids=verified.token_ids
        )
        if verified.logprobs is not None:
            ids = verified.logprobs.token_ids.tolist()
            values = verified.logprobs.logprobs.tolist()
            ranks = verified.logprobs.ranks.tolist()
            spans = [
                range(start, start + len(t))
                for start, t in zip(verified.row_starts, verified.token_ids)
            ]
            output.logprob_token_ids = [[ids[r] for r in span] for span in spans]
            output.logprobs = [[values[r] for r in span] for span in spans]
            output.sampled_token_ranks = [[ranks[r] for r in span] for span in spans]
        return output

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)
