"""Joining a Ray cluster and reserving room on it, for whatever tokenmill places there
(tensor- and pipeline-parallel ranks, `ray_workers.py`; data-parallel replicas,
`entrypoints/router/launching/ray_replicas.py`). Light to import: Ray and tokenmill.config,
no torch (a replica's actor imports it)."""

from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from tokenmill.config import ConfigError

# How long the cluster may take to find room for every bundle before a start fails.
PLACEMENT_TIMEOUT_S = 120.0

logger = logging.getLogger(__name__)


def connect() -> None:
    """Join this machine's Ray cluster (RAY_ADDRESS, or one `ray start` began here), else
    start a local one; nothing if this process has joined one already."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):  # that cluster, or Ray's error: never a local one instead
        ray.init(logging_level=logging.WARNING)
        return
    try:
        ray.init(address="auto", logging_level=logging.WARNING)
    except ConnectionError:
        logger.info("no running Ray cluster found: starting a local one")
        ray.init(include_dashboard=False, logging_level=logging.WARNING)


def reserve(bundles: list[dict[str, float]], strategy: str, what: str) -> PlacementGroup:
    """A placement group of `bundles`, once the cluster has room for all of them; a
    `ConfigError` saying how many CPUs it has if it finds none in PLACEMENT_TIMEOUT_S (`what`:
    what the bundles are for, e.g. "2 ranks of 1 CPU")."""
    group = placement_group(bundles, strategy=strategy)
    needed = sum(b.get("CPU", 0) for b in bundles)
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < needed:  # an autoscaler may still add nodes
        logger.warning(
            "the Ray cluster has %g CPUs for %s: waiting up to %g s for more",
            cpus, what, PLACEMENT_TIMEOUT_S,
        )  # fmt: skip
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ConfigError(
            f"the Ray cluster found no room for {what} in {PLACEMENT_TIMEOUT_S:g} s (it has "
            f"{ray.cluster_resources().get('CPU', 0):g} CPUs in all; `ray status` shows what "
            "is taken)"
        ) from None
    return group


def first_line(error: BaseException) -> str:
    """An error's first line, for a one-line report (Ray's errors run to many)."""
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__
