"""`tokenmill serve MODEL --disaggregate`: prefill/decode disaggregation on one machine in one
command. A prefill instance (a `kv_producer`) and a decode instance (a `kv_consumer`), each a
`tokenmill serve` on a private loopback port and pinned to its own half of this process's CPUs
(one each on a 2-core machine), their KV moved by the P2P connector over loopback, behind the
router on the command's own port. The instances are restarted when they die and drained with
the command, as `--data-parallel-size` replicas are (supervisor.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket

from tokenmill.bench.server_process import free_port
from tokenmill.config import KVTransferConfig
from tokenmill.entrypoints.router.data_parallel import route_to_supervised
from tokenmill.entrypoints.router.supervisor import ReplicaLaunch, ReplicaSupervisor

logger = logging.getLogger("tokenmill.router")


def split_cpus(cpus: set[int]) -> tuple[frozenset[int], frozenset[int]]:
    """The prefill instance's CPUs and the decode instance's: halves of `cpus` (the prefill
    takes the extra one of an odd count: a prompt's prefill is the heavier work). With one
    CPU both share it."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return frozenset(ordered), frozenset(ordered)
    half = (len(ordered) + 1) // 2
    return frozenset(ordered[:half]), frozenset(ordered[half:])


def kv_transfer_configs(kv_port: int, given: KVTransferConfig | None = None) -> tuple[str, str]:
    """The two instances' `--kv-transfer-config`: the producer listens on loopback. A
    `--kv-transfer-config` given with `--disaggregate` adds its P2P options (its
    `kv_connector_extra_config`, `kv_load_failure_policy`) to both."""
    common: dict = {"kv_connector": "P2pConnector", "kv_ip": "127.0.0.1"}
    if given is not None:
        if given.kv_connector != "P2pConnector":
            raise ValueError("--disaggregate moves KV with the P2pConnector")
        common["kv_connector_extra_config"] = given.kv_connector_extra_config
        common["kv_load_failure_policy"] = given.kv_load_failure_policy
    producer = {**common, "kv_role": "kv_producer", "kv_port": kv_port}
    consumer = {**common, "kv_role": "kv_consumer"}
    return json.dumps(producer), json.dumps(consumer)


def run_disaggregated(args: argparse.Namespace, listener: socket.socket, argv: list[str]) -> int:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    producer, consumer = kv_transfer_configs(free_port(), args.kv_transfer_config)
    prefill_cpus, decode_cpus = split_cpus(os.sched_getaffinity(0))
    launches = [
        ReplicaLaunch(("--kv-transfer-config", producer, "--no-disaggregate"), prefill_cpus),
        ReplicaLaunch(("--kv-transfer-config", consumer, "--no-disaggregate"), decode_cpus),
    ]
    supervisor = ReplicaSupervisor(argv, ports, launches)
    logger.info(
        "started a prefill instance on %s (pid %d, CPUs %s) and a decode instance on %s "
        "(pid %d, CPUs %s)",
        urls[0], supervisor.children[0].pid, sorted(prefill_cpus),
        urls[1], supervisor.children[1].pid, sorted(decode_cpus),
    )  # fmt: skip
    args.prefill, args.decode = urls[:1], urls[1:]
    return route_to_supervised(args, listener, supervisor, urls, [])
