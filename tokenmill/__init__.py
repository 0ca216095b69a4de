"""tokenmill: an LLM serving engine with continuous batching over a paged KV cache."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Before torch loads: see tokenmill/openmp.py.
import tokenmill.openmp  # noqa: F401
from tokenmill.version import __version__ as __version__

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.lora.request import LoRARequest
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.structured_output import StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]

# Imported on first use, so `import tokenmill.core...` (and the CLI's --help) stays light.
_LAZY = {
    "LLM": "tokenmill.entrypoints.llm",
    "EngineConfig": "tokenmill.config",
    "LoRARequest": "tokenmill.lora.request",
    "CompletionOutput": "tokenmill.outputs",
    "RequestOutput": "tokenmill.outputs",
    "SamplingParams": "tokenmill.sampling_params",
    "StructuredOutputsParams": "tokenmill.structured_output",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
