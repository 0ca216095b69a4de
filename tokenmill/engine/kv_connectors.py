"""The engine's KV connector (tokenmill/kv_transfer/): the ring of each request's transfers,
and its two halves' stats summed (`assembly.py` makes the halves)."""

from __future__ import annotations

from tokenmill.kv_transfer.base import KVConnectorPair
from tokenmill.metrics.recent import REQUEST_HISTORY
from tokenmill.metrics.ring import Ring
from tokenmill.metrics.stats import KVTransferRecord, KVTransferStats
from tokenmill.step.runner_output import ModelRunnerOutput


def transfer_ring(connectors: KVConnectorPair | None) -> Ring[KVTransferRecord] | None:
    """Where the engine keeps each request's transfer, for /metrics and the dashboard."""
    return None if connectors is None else Ring(REQUEST_HISTORY)


def record_transfers(ring: Ring[KVTransferRecord] | None, output: ModelRunnerOutput) -> None:
    if ring is not None and output.kv_connector_output is not None:
        for record in output.kv_connector_output.transfers:
            ring.append(record)


def kv_transfer_stats(connectors: KVConnectorPair | None) -> KVTransferStats | None:
    if connectors is None:
        return None
    return connectors.stats()
