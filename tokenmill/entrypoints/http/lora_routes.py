"""vLLM's runtime adapter routes, `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`:
mounted only with --enable-lora and TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING set, behind the API
key like every /v1 route. Success is vLLM's plain-text line; failures are OpenAI error
objects (400 for a bad or duplicate adapter, 404 for unloading one that is not there)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tokenmill.entrypoints.http.lora_adapters import LoRAModule, ServedAdapters
from tokenmill.entrypoints.http.transport.errors import NOT_FOUND, OpenAIError, bad_request
from tokenmill.entrypoints.http.transport.offloop_body import OffLoopBodyRoute
from tokenmill.lora.peft_adapter import LoRAAdapterError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = ""
    lora_path: str = ""
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str = ""
    lora_int_id: int | None = None


def lora_router(adapters: ServedAdapters, responses: dict[int | str, Any]) -> APIRouter:
    """The two routes, for the /v1 router (its prefix and API-key check apply)."""
    router = APIRouter(route_class=OffLoopBodyRoute)

    @router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=responses)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if not request.lora_name or not request.lora_path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        module = LoRAModule(request.lora_name, request.lora_path, request.base_model_name)
        if module.name in adapters:
            raise bad_request(f"The lora adapter '{module.name}' has already been loaded.")
        try:
            await asyncio.to_thread(adapters.add, module)
        except (LoRAAdapterError, ValueError) as e:
            raise bad_request(str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{module.name}' added successfully.")

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=responses)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if not request.lora_name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.")
        try:
            adapters.remove(request.lora_name)
        except KeyError:
            raise OpenAIError(
                404,
                f"The lora adapter '{request.lora_name}' cannot be found.",
                NOT_FOUND,
                param="lora_name",
            ) from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        )

    return router
