"""`tokenmill serve MODEL --disaggregate`: prefill/decode disaggregation on one machine in one
command. A prefill instance (a `kv_producer`) and a decode instance (a `kv_consumer`), each a
`tokenmill serve` on a private loopback port and pinned to its own half of this process's CPUs
(one each on a 2-core machine), their KV moved by the P2P connector over loopback, behind the
router on the command's own port. The decode instance's CPUs are its steps' alone: the router
and the decode instance's KV receiving thread run on the prefill instance's (which is niced:
`PREFILL_NICE`). The instances are restarted when they die and drained with
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
from tokenmill.entrypoints.router.launching.serve_data_parallel import route_to_supervised
from tokenmill.entrypoints.router.launching.supervisor import ReplicaLaunch, ReplicaSupervisor

logger = logging.getLogger("tokenmill.router")
# The prefill instance's nice value: its CPUs also run the router (which relays every streamed
# token) and the decode instance's KV receiver, whose delays the streams feel; a prompt's
# prefill is throughput work.
PREFILL_NICE = 10


def split_cpus(cpus: set[int]) -> tuple[frozenset[int], frozenset[int]]:
    """The prefill instance's CPUs and the decode instance's: halves of `cpus` (the prefill
    takes the extra one of an odd count: a prompt's prefill is the heavier work). With one
    CPU both share it."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return frozenset(ordered), frozenset(ordered)
    half = (len(ordered) + 1) // 2
    return frozenset(ordered[:half]), frozenset(ordered[half:])


def kv_transfer_configs(
    kv_port: int, given: KVTransferConfig | None = None, recv_cpus: frozenset[int] | None = None
) -> tuple[str, str]:
    """The two instances' `--kv-transfer-config`: the producer listens on loopback, and the
    consumer receives on `recv_cpus` (the prefill instance's: idle once it has sent, where
    the decode instance's cores are busy decoding) unless the given config says otherwise. A
    `--kv-transfer-config` given with `--disaggregate` adds its P2P options (its
    `kv_connector_extra_config`, `kv_load_failure_policy`) to both."""
    common: dict = {"kv_connector": "P2pConnector", "kv_ip": "127.0.0.1"}
    extra: dict = {}
    if given is not None:
        if given.kv_connector != "P2pConnector":
            raise ValueError("--disaggregate moves KV with the P2pConnector")
        extra = dict(given.kv_connector_extra_config)
        common["kv_load_failure_policy"] = given.kv_load_failure_policy
    producer = {**common, "kv_role": "kv_producer", "kv_port": kv_port}
    consumer = {**common, "kv_role": "kv_consumer"}
    if recv_cpus is not None and "recv_cpus" not in extra:
        consumer["kv_connector_extra_config"] = {**extra, "recv_cpus": sorted(recv_cpus)}
    if extra:
        producer["kv_connector_extra_config"] = extra
        consumer.setdefault("kv_connector_extra_config", extra)
    return json.dumps(producer), json.dumps(consumer)


def run_disaggregated(args: argparse.Namespace, listener: socket.socket, argv: list[str]) -> int:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    prefill_cpus, decode_cpus = split_cpus(os.sched_getaffinity(0))
    separate = prefill_cpus != decode_cpus
    producer, consumer = kv_transfer_configs(
        free_port(), args.kv_transfer_config, prefill_cpus if separate else None
    )
    launches = [
        ReplicaLaunch(
            ("--kv-transfer-config", producer, "--no-disaggregate"),
            prefill_cpus,
            PREFILL_NICE if separate else 0,
        ),
        ReplicaLaunch(("--kv-transfer-config", consumer, "--no-disaggregate"), decode_cpus),
    ]
    supervisor = ReplicaSupervisor(argv, ports, launches)
    if separate:
        os.sched_setaffinity(0, prefill_cpus)  # the router's streaming off the decode cores
    logger.info(
        "started a prefill instance on %s (pid %d, CPUs %s) and a decode instance on %s "
        "(pid %d, CPUs %s)",
        urls[0], supervisor.children[0].pid, sorted(prefill_cpus),
        urls[1], supervisor.children[1].pid, sorted(decode_cpus),
    )  # fmt: skip
    args.prefill, args.decode = urls[:1], urls[1:]
    return route_to_supervised(args, listener, supervisor, urls, [])
