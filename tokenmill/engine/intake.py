"""One intake: a request is checked and resolved once, where it enters the engine, into a
`ResolvedRequest` that the engine, the output processor and the scheduler trust.

Checked here and nowhere after: the prompt (not empty, token ids in the vocabulary, within the
context), the token ids of `logit_bias` and `stop_token_ids`, the cache salt, the
structured-output constraint, and the KV connector's `kv_transfer_params`. Resolved here: the
prompt's token ids, `max_tokens` (never past the context), and the engine's own copy of the
sampling parameters with the model's stop tokens and the output kind the caller wants: the
caller's `SamplingParams` is never written.
The server adds its own HTTP rules before this (vLLM's 400 when prompt + max_tokens exceed
the context, a byte cap before tokenizing), and shares `check_prompt_tokens` for /tokenize.

What comes in is an `EngineRequest`, made once where a request enters tokenmill (the
server's generation run, `LLM.generate`, `LLMEngine.add_request`) and carried here whole.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from tokenmill.kv_transfer.base import KVConnectorBase
from tokenmill.lora.adapter_store import LoRAAdapterStore
from tokenmill.lora.peft_adapter import LoRAAdapterError, PeftAdapter
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import (
    InvalidRequestError,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from tokenmill.structured_output.manager import StructuredOutputManager

PromptType = str | list[int]


@dataclass(frozen=True)
class EngineRequest:
    """A request as a caller hands it to the engine, unchecked (the intake checks it)."""

    request_id: str  # the caller's, which its outputs carry (its samples': `sample_id`)
    prompt: PromptType  # text, or token ids
    params: SamplingParams  # the caller's: never written
    arrival_time: float | None = None  # None: when the intake takes it
    add_special_tokens: bool = True  # False for text that carries them (a chat template's)
    priority: int = 0  # lower runs first, under the priority policy
    cache_salt: str | None = None  # isolates a tenant's prefix-cache entries
    output_kind: RequestOutputKind | None = None  # None: as `params` says
    lora_request: LoRARequest | None = None  # the LoRA adapter to run with; None: the base


class PromptTooLongError(InvalidRequestError):
    """The prompt alone does not fit the model's context (the server answers it in vLLM's
    words, code `context_length_exceeded`)."""

    def __init__(self, param: str, num_tokens: int, max_model_len: int) -> None:
        super().__init__(
            param,
            f"has {num_tokens} tokens, more than this model's maximum context length "
            f"(max_model_len={max_model_len})",
        )
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len


def check_prompt_tokens(
    token_ids: list[int], vocab_size: int, max_model_len: int, param: str = "prompt"
) -> None:
    """Raise `InvalidRequestError` for a prompt the model cannot take."""
    if not token_ids:
        raise InvalidRequestError(param, "must not be empty")
    check_token_ids(token_ids, vocab_size, param)
    if len(token_ids) > max_model_len:
        raise PromptTooLongError(param, len(token_ids), max_model_len)


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            param, f"token id {bad} is outside the vocabulary [0, {vocab_size})"
        )


def check_cache_salt(cache_salt: str | None) -> None:
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


def check_kv_transfer_params(connector: KVConnectorBase | None, params: SamplingParams) -> None:
    """`kv_transfer_params` (vLLM's field, in `extra_args`) the connector can use; without a
    connector they mean nothing here and are ignored (as in vLLM)."""
    transfer = (params.extra_args or {}).get("kv_transfer_params")
    if transfer is None or connector is None:
        return
    if not isinstance(transfer, dict):
        raise InvalidRequestError("kv_transfer_params", "must be an object")
    try:
        connector.check_kv_transfer_params(transfer)
    except ValueError as e:
        raise InvalidRequestError("kv_transfer_params", str(e)) from None


def sample_id(request_id: str, index: int, n: int) -> str:
    """The id of sample `index` of a request with `n` samples: the request's own id when
    n == 1, else `{index}_{request_id}` (as vLLM names a parent request's children). The
    scheduler, the runner and the KV connectors know a sample by it; callers only ever see
    the request's id."""
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass(frozen=True)
class ResolvedRequest:
    """A request as the engine takes it: checked, with everything resolved. Nothing
    downstream changes it (its `params` is the engine's own copy)."""

    request_id: str
    prompt: str | None  # the text, when the caller sent text
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int  # tokens to generate at most: as asked, never past max_model_len
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    lora: PeftAdapter | None = None  # its LoRA adapter, loaded; None: the base model

    def sample_ids(self) -> list[str]:
        """The ids the scheduler and the runner know the `n` samples by (`sample_id`)."""
        return [sample_id(self.request_id, index, self.params.n) for index in range(self.params.n)]

    def sample_params(self) -> list[SamplingParams]:
        """The parameters of each of the `n` samples: one sample each, seeds `seed + index`
        (the one sample of `n == 1` is the request's own)."""
        params = self.params
        if params.n == 1:
            return [params]
        samples = []
        for index in range(params.n):
            sample = copy.copy(params)  # shares the (never written) lists of the request's
            sample.n = 1
            if params.seed is not None:
                sample.seed = params.seed + index
            samples.append(sample)
        return samples


class RequestIntake:
    """Where requests enter the engine. Stateless but for its settings: safe on any thread
    (the tokenizer's `encode` and the grammar validation are)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: set[int],
        structured_output: StructuredOutputManager,
        kv_connector: KVConnectorBase | None = None,
        lora_store: LoRAAdapterStore | None = None,
    ) -> None:
        """`kv_connector`: the scheduler half of the engine's, if any; `lora_store`: the
        loaded LoRA adapters (None: LoRA is off)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.structured_output = structured_output
        self.kv_connector = kv_connector
        self.lora_store = lora_store

    def resolve(self, request: EngineRequest) -> ResolvedRequest:
        """Raises `InvalidRequestError` naming the field for anything the engine can't take."""
        params = request.params
        if isinstance(params.structured_outputs, StructuredOutputsParams):
            self.structured_output.validate(params.structured_outputs)
        check_kv_transfer_params(self.kv_connector, params)
        text, token_ids = self._tokenize(request.prompt, request.add_special_tokens)
        check_prompt_tokens(token_ids, self.vocab_size, self.max_model_len)
        check_token_ids(params.logit_bias or (), self.vocab_size, "logit_bias")
        check_token_ids(params.stop_token_ids or (), self.vocab_size, "stop_token_ids")
        check_cache_salt(request.cache_salt)
        lora = self._lora(request.lora_request)
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        engine_params = params.clone()
        engine_params.all_stop_token_ids = set(self.eos_token_ids)
        if request.output_kind is not None:
            engine_params.output_kind = request.output_kind
        arrival_time = request.arrival_time
        return ResolvedRequest(
            request.request_id,
            text,
            tuple(token_ids),
            engine_params,
            max_tokens,
            time.time() if arrival_time is None else arrival_time,
            request.priority,
            request.cache_salt,
            lora,
        )

    def _lora(self, lora_request: LoRARequest | None) -> PeftAdapter | None:
        """The adapter, loaded (read from disk here unless the store holds it)."""
        if lora_request is None:
            return None
        if self.lora_store is None:
            raise InvalidRequestError("lora_request", "LoRA is not enabled (enable_lora)")
        try:
            return self.lora_store.get(lora_request)
        except LoRAAdapterError as e:
            raise InvalidRequestError("lora_request", str(e)) from None

    def _tokenize(
        self, prompt: PromptType, add_special_tokens: bool
    ) -> tuple[str | None, list[int]]:
        """`add_special_tokens=False` is for text that already carries them, such as a
        rendered chat template (which starts with BOS itself)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("prompt", "must be a string or a list of token ids")
