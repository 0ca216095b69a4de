"""`--kv-transfer-config`: which KV connector moves KV blocks in and out of this engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.config.base import ConfigError, check_choice, json_config_fields

# kv_producer: saves the KV it computes; kv_consumer: loads KV computed elsewhere; kv_both.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """`--kv-transfer-config` as vLLM takes it, e.g. `{"kv_connector": "SharedStorageConnector",
    "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": DIR}}`: which
    KV connector moves KV blocks in and out of this engine (tokenmill/kv_transfer/)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | KVTransferConfig | None
    ) -> KVTransferConfig | None:
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_config_fields(value, "kv_transfer_config", cls)
        if "kv_connector" not in value:
            raise ConfigError("kv_transfer_config needs a kv_connector (its name)")
        return cls(**value)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ConfigError(f"kv_connector must be a connector name, got {self.kv_connector!r}")
        check_choice("kv_role", self.kv_role, KV_ROLES)
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_connector_extra_config must be a JSON object")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
