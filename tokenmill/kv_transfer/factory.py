"""Connectors by name, as `kv_transfer_config.kv_connector` names them (imported lazily)."""

from __future__ import annotations

import importlib
import uuid

from tokenmill.config import ConfigError, KVTransferConfig
from tokenmill.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorPair,
    KVConnectorRole,
)

# name -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {}


def register_connector(name: str, module: str, class_name: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"a KV connector named {name!r} is already registered")
    _REGISTRY[name] = (module, class_name)


def connector_names() -> list[str]:
    return sorted(_REGISTRY)


def create_connector(
    config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
) -> KVConnectorBase:
    if config.kv_connector not in _REGISTRY:
        raise ConfigError(
            f"unknown kv_connector {config.kv_connector!r}: one of {connector_names()}"
        )
    module, class_name = _REGISTRY[config.kv_connector]
    cls = getattr(importlib.import_module(module), class_name)
    return cls(config, role, context)


register_connector(
    "SharedStorageConnector", "tokenmill.kv_transfer.storage", "SharedStorageConnector"
)
register_connector("P2pConnector", "tokenmill.kv_transfer.p2p.connector", "P2pConnector")


def create_connector_pair(config: KVTransferConfig, context: KVConnectorContext) -> KVConnectorPair:
    """The scheduler-side and worker-side instances of the configured connector, sharing
    one config (a P2P producer's worker half records there the port it bound)."""
    if config.engine_id is None:
        config.engine_id = uuid.uuid4().hex
    return KVConnectorPair(
        scheduler=create_connector(config, KVConnectorRole.SCHEDULER, context),
        worker=create_connector(config, KVConnectorRole.WORKER, context),
    )
