"""What every endpoint shares: the engine, the model's names, and small helpers on outputs."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.async_engine import AsyncEngine, EngineStepError
from tokenmill.entrypoints.http.lora_adapters import ServedAdapters
from tokenmill.entrypoints.http.openai.inputs import PromptBuilder
from tokenmill.entrypoints.http.openai.protocol import (
    FinishReason,
    PromptTokensDetails,
    RequestModel,
    UsageInfo,
)
from tokenmill.entrypoints.http.replies.reply_parsing import ReplyParsing
from tokenmill.entrypoints.http.replies.structured_outputs import prepare
from tokenmill.entrypoints.http.transport.errors import model_not_found
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import CompletionOutput
from tokenmill.sampling_params import StructuredOutputsParams

logger = logging.getLogger("tokenmill.server")

P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class ServerContext:
    engine: AsyncEngine
    model_names: list[str]  # the first is the one responses report
    model_root: str  # where the weights came from
    created: int = field(default_factory=lambda: int(time.time()))
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details (cached_tokens)
    slos: dict[str, float] = field(default_factory=dict)  # --slo, in seconds, for goodput
    stopping: bool = False  # set when shutdown begins: endless streams (the dashboard) end
    reply_parsing: ReplyParsing = field(default_factory=ReplyParsing)  # tools, reasoning
    adapters: ServedAdapters | None = None  # LoRA adapters served by name (--enable-lora)

    def __post_init__(self) -> None:
        self.prompts = PromptBuilder(
            self.engine.tokenizer, self.engine.vocab_size, self.engine.max_model_len
        )
        # One thread, as vLLM's async tokenizer: tokenizing is off the event loop (a long
        # prompt froze every client for seconds) and never concurrent with itself.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-tokenizer")
        # Structured-output constraints are checked on their own thread: a large schema
        # delays only requests that carry one, not every request's tokenizing.
        self._schema_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-schema-check")

    async def off_loop(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run tokenizer work on the tokenizer thread, leaving the event loop to others."""
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, call)

    async def prepare_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Check the constraint and wait for its grammar (structured_outputs.prepare)."""
        await prepare(self.engine.engine.parts.structured_output, params, self._schema_thread)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self._schema_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def weight_format(self) -> str:
        return self.engine.engine.parts.weight_format

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """The model's generation_config.json sampling fields, for requests that omit them."""
        return self.engine.default_sampling

    def refused(self, body: Any) -> None:
        """A request refused before it was queued (bad input, or a client gone before it
        was; `body` parsed or a request model): the engine's KV connector lets go of the KV
        its `kv_transfer_params` point at (on a decode instance: the prefill instance's
        hold, else kept until its lease ends)."""
        if isinstance(body, dict):
            params = body.get("kv_transfer_params")
        else:
            params = getattr(body, "kv_transfer_params", None)
        if isinstance(params, dict):
            self.engine.refuse_kv_transfer_params(params)

    def check_model(self, model: str | None) -> None:
        """Clients name the model in every request; a name we do not serve is their error."""
        if model is None or model in self.model_names:
            return
        if self.adapters is None or model not in self.adapters:
            adapters = [a.lora_name for a in self.adapters or ()]
            raise model_not_found(model, self.model_names + adapters)

    async def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, loaded (off the loop); None for the base model."""
        request = None if self.adapters is None else self.adapters.get(model)
        if request is not None:
            await self.adapters.loaded(request)
        return request

    def reported_model(self, model: str | None) -> str:
        """The `model` a response reports: the adapter's name, else the served name."""
        return model if self.adapters is not None and model in self.adapters else self.model_name


def log_ignored_fields(request: RequestModel, endpoint: str) -> None:
    if request.model_extra:
        logger.warning(
            "%s: ignoring fields this server does not know: %s",
            endpoint,
            sorted(request.model_extra),
        )


def finish_reason(completion: CompletionOutput) -> FinishReason | None:
    """OpenAI's finish reasons; any other ending (the engine failed it) is an error."""
    reason = completion.finish_reason
    if reason is None or reason in ("stop", "length", "error"):
        return reason  # type: ignore[return-value]
    raise EngineStepError(f"the request ended with finish_reason={reason!r}")


def make_usage(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached: int, details: bool
) -> UsageInfo:
    """`prompt_tokens_details` only when the server enables it (`details`), as vLLM: cached
    tokens tell a client whether someone else's prompt shares its prefix."""
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached) if details else None,
    )
