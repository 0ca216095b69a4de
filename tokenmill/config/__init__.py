"""Every engine knob, with its default and its validation, in one place: `EngineConfig`
(`engine.py`) and the JSON-valued settings it holds (`speculative.py`,
`structured_outputs.py`, `kv_transfer.py`); `base.py` what they share."""

from tokenmill.config.base import ConfigError, config_field, json_config_fields
from tokenmill.config.engine import (
    ATTENTION_BACKENDS,
    DEFAULT_CPU_KV_CACHE_BYTES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from tokenmill.config.kv_events import KVEventsConfig
from tokenmill.config.kv_transfer import KVTransferConfig
from tokenmill.config.speculative import (
    SPECULATIVE_FIELD_TYPES,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
)
from tokenmill.config.structured_outputs import StructuredOutputsConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "DEFAULT_CPU_KV_CACHE_BYTES",
    "KV_CACHE_DTYPES",
    "PREEMPTION_MODES",
    "SCHEDULING_POLICIES",
    "SPECULATIVE_FIELD_TYPES",
    "SPECULATIVE_METHODS",
    "ConfigError",
    "EngineConfig",
    "KVEventsConfig",
    "KVTransferConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "config_field",
    "json_config_fields",
]
