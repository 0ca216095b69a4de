"""The LoRA adapters a server serves by name, as vLLM does: `--lora-modules name=path` (or
the JSON form with `base_model_name`) at start-up, and, with
TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING set, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` behind the API key. A request's `model` field names an adapter;
`/v1/models` lists each with its parent. Adapters are read from disk on a worker thread, off
the event loop and the engine's step loop."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora.adapter_store import LoRAAdapterStore
from tokenmill.lora.peft_adapter import LoRAAdapterError
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import InvalidRequestError

RUNTIME_UPDATING_ENV = "TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true" turns the routes on."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModule:
    """`name=path`, or `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError."""
    if value.lstrip().startswith("{"):
        try:
            fields = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON: {e}") from None
        unknown = set(fields) - {"name", "path", "base_model_name"}
        if unknown or not fields.get("name") or not fields.get("path"):
            raise ValueError(
                f"--lora-modules {value!r}: a JSON module has 'name' and 'path' (and "
                f"optionally 'base_model_name'){f', not {sorted(unknown)}' if unknown else ''}"
            )
        return LoRAModule(fields["name"], fields["path"], fields.get("base_model_name"))
    name, equals, path = value.partition("=")
    if not equals or not name or not path:
        raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
    return LoRAModule(name, path)


class ServedAdapters:
    """Adapter name -> its `LoRARequest` (a fresh id each time a name is loaded, so that a
    reloaded adapter never shares the prefix cache of the one it replaced)."""

    def __init__(self, store: LoRAAdapterStore, base_model_name: str) -> None:
        self.store = store
        self.base_model_name = base_model_name
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._by_name.values()))

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def add(self, module: LoRAModule) -> LoRARequest:
        """Register `module` (read and checked now); LoRAAdapterError if it cannot run,
        ValueError if the name is taken."""
        if module.name in self._by_name:
            raise ValueError(f"The lora adapter '{module.name}' has already been loaded.")
        request = LoRARequest(
            module.name,
            next(self._ids),
            module.path,
            module.base_model_name or self.base_model_name,
        )
        self.store.get(request)
        self._by_name[module.name] = request
        return request

    def remove(self, name: str) -> LoRARequest:
        """KeyError if no adapter has that name; requests running with it finish with it."""
        request = self._by_name.pop(name)
        self.store.remove(request.lora_int_id)
        return request

    async def loaded(self, request: LoRARequest) -> None:
        """Read the adapter from disk, on a worker thread, unless the store holds it; a 400
        for one that cannot run (its files gone or changed since it was registered)."""
        try:
            await asyncio.to_thread(self.store.get, request)
        except LoRAAdapterError as e:
            raise InvalidRequestError("model", str(e)) from None


def served_adapters(
    engine: LLMEngine, lora_modules: list[str] | None, base_model_name: str
) -> ServedAdapters | None:
    """The server's adapters, each `--lora-modules` value read and checked at start-up
    (ValueError naming the bad one); None without --enable-lora."""
    store = engine.parts.lora_store
    if store is None:
        if lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    adapters = ServedAdapters(store, base_model_name)
    for value in lora_modules or ():
        module = parse_lora_module(value)
        try:
            adapters.add(module)
        except LoRAAdapterError as e:
            raise ValueError(f"--lora-modules {module.name}: {e}") from None
    return adapters
