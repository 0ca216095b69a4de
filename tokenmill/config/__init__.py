"""Every engine knob, with its default and its validation, in one place: `EngineConfig`
(`engine.py`) and the JSON-valued settings it holds."""

from tokenmill.config.engine import (
    ATTENTION_BACKENDS,
    DEFAULT_CPU_KV_CACHE_BYTES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    SPECULATIVE_FIELD_TYPES,
    SPECULATIVE_METHODS,
    ConfigError,
    EngineConfig,
    KVTransferConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    config_field,
    json_config_fields,
)

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
    "KVTransferConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "config_field",
    "json_config_fields",
]
