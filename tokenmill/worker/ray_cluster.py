"""Joining a Ray cluster, for whatever tokenmill places on one (tensor- and pipeline-parallel
ranks, `ray_workers.py`; data-parallel replicas, `entrypoints/router/launching/
ray_replicas.py`). Light to import: Ray only, no torch (a replica's actor imports it)."""

from __future__ import annotations

import logging
import os

import ray

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


def first_line(error: BaseException) -> str:
    """An error's first line, for a one-line report (Ray's errors run to many)."""
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__
