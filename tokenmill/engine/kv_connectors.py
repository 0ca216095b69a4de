"""The engine's KV connector (tokenmill/kv_transfer/): its two halves made from the config,
the check of a request's `kv_transfer_params`, and the halves' stats summed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokenmill.config import KVTransferConfig
from tokenmill.core.scheduler_output import ModelRunnerOutput
from tokenmill.kv_transfer.base import KVConnectorBase, KVConnectorContext
from tokenmill.kv_transfer.factory import create_connector_pair
from tokenmill.kv_transfer.fingerprint import model_fingerprint, transfer_fingerprint
from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.metrics.recent import REQUEST_HISTORY
from tokenmill.metrics.ring import Ring
from tokenmill.metrics.stats import KVTransferRecord, KVTransferStats
from tokenmill.request import Request
from tokenmill.sampling_params import InvalidRequestError, SamplingParams

# (scheduler half, worker half)
KVConnectors = tuple[KVConnectorBase, KVConnectorBase]


def make_kv_connectors(
    config: KVTransferConfig | None,
    model_dir: Path,
    compute_dtype: str,
    kv_spec: KVCacheSpec,
    block_hashes: Callable[[Request], list[bytes]],
) -> KVConnectors | None:
    if config is None:
        return None
    context = KVConnectorContext(
        kv_spec,
        model_fingerprint(model_dir, compute_dtype, kv_spec),
        block_hashes,
        transfer_fingerprint(model_dir, compute_dtype, kv_spec),
    )
    return create_connector_pair(config, context)


def transfer_ring(connectors: KVConnectors | None) -> Ring[KVTransferRecord] | None:
    """Where the engine keeps each request's transfer, for /metrics and the dashboard."""
    return None if connectors is None else Ring(REQUEST_HISTORY)


def record_transfers(ring: Ring[KVTransferRecord] | None, output: ModelRunnerOutput) -> None:
    if ring is not None and output.kv_connector_output is not None:
        for record in output.kv_connector_output.transfers:
            ring.append(record)


def check_kv_transfer_params(connectors: KVConnectors | None, params: SamplingParams) -> None:
    """InvalidRequestError for `kv_transfer_params` the connector cannot use; without a
    connector they mean nothing here and are ignored (as in vLLM)."""
    transfer = (params.extra_args or {}).get("kv_transfer_params")
    if transfer is None or connectors is None:
        return
    if not isinstance(transfer, dict):
        raise InvalidRequestError("kv_transfer_params", "must be an object")
    try:
        connectors[0].check_kv_transfer_params(transfer)
    except ValueError as e:
        raise InvalidRequestError("kv_transfer_params", str(e)) from None


def kv_transfer_stats(connectors: KVConnectors | None) -> KVTransferStats | None:
    if connectors is None:
        return None
    return connectors[0].stats() + connectors[1].stats()
