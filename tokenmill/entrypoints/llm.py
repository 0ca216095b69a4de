"""The offline batch API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.engine.intake import EngineRequest, PromptType
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.default_model import with_default_models
from tokenmill.entrypoints.pooling_llm import PoolingMethods
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import EngineStats
from tokenmill.outputs import RequestOutput
from tokenmill.pooling.config import resolve_task
from tokenmill.pooling.service import build_pooling_service
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

ChatMessage = dict[str, Any]


class LLM(PoolingMethods):
    """Generates for many prompts at once; every prompt shares each forward pass. A pooling
    model (`task`, or `auto` from the checkpoint) embeds and scores instead (`embed`,
    `score`: entrypoints/pooling_llm.py)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        if "speculative_config" in engine_args:  # a dict or JSON, as vLLM's LLM takes it
            engine_args["speculative_config"] = SpeculativeConfig.parse(
                engine_args["speculative_config"]
            )
        config = EngineConfig(model=model, **engine_args)
        task = resolve_task(config.task, config.model)
        if task != "generate":
            self.pooling = build_pooling_service(config, task)
            return
        self.engine = LLMEngine(with_default_models(config))
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.pooling.tokenizer if self.pooling is not None else self.engine.tokenizer

    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """What `generate` uses without sampling params: the model's generation_config.json
        defaults (see `EngineConfig.generation_config`), then `overrides`."""
        return self.engine.default_sampling_params(**overrides)

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (else at garbage collection or exit)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_special_tokens: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A single string or token-id list is one prompt.
        `priority` (one per prompt, lower first) matters under `scheduling_policy="priority"`.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model), as in vLLM; needs `enable_lora=True`."""
        if self.pooling is not None:
            raise ValueError(
                f"this LLM serves a pooling model (task {self.pooling.task!r}): use embed() "
                "or score(), or task='generate' for a model that generates"
            )
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _broadcast(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = _broadcast_lora(lora_request, len(prompts))
        request_ids = []
        for prompt, params, request_priority, lora in zip(prompts, params_list, priorities, loras):
            request_id = str(next(self._request_counter))
            self.engine.add(
                EngineRequest(
                    request_id,
                    prompt,
                    params,
                    add_special_tokens=add_special_tokens,
                    priority=request_priority,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                    lora_request=lora,
                )
            )
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts: list[PromptType] = [
            self.engine.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            for conversation in conversations
        ]
        # The template writes BOS and the other special tokens itself.
        return self.generate(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start = time.perf_counter()
        start_stats = self.engine.get_stats()
        try:
            while self.engine.has_unfinished_requests():
                num_finished = len(finished)
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                if use_tqdm and len(finished) > num_finished:  # as vLLM: not every step
                    progress.set_postfix_str(self._throughput(start, start_stats), refresh=False)
                    progress.update(len(finished) - num_finished)
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            progress.close()
        return [finished[r] for r in request_ids]

    def _throughput(self, start: float, start_stats: EngineStats) -> str:
        elapsed = max(time.perf_counter() - start, 1e-9)
        stats = self.engine.get_stats()
        prompt = (stats.num_prompt_tokens - start_stats.num_prompt_tokens) / elapsed
        output = (stats.num_generation_tokens - start_stats.num_generation_tokens) / elapsed
        return f"input: {prompt:.1f} toks/s, output: {output:.1f} toks/s"


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)


def _broadcast_lora(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    if len(lora) != count:
        raise ValueError(f"got {len(lora)} LoRA requests for {count} prompts")
    return list(lora)
