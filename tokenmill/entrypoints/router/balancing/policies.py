"""Which replica a request goes to: round-robin, least-loaded, prefix-aware.

Plain Python over replica names and load numbers (no I/O), so that the router, the routing
simulator (benchmarks/route_sim.py) and the unit tests share one implementation.

Prefix-aware routing hashes the prompt's first characters (`prefix_key`) and picks the
replica by rendezvous (highest-random-weight) hashing: each (key, replica) pair gets a
pseudo-random score and the highest wins, so a prefix always lands on the same replica, and
when a replica leaves or joins only the keys it owned move. It is bounded by load as SGLang's
router bounds its cache-aware policy: when the chosen replica holds more than
`balance_abs_threshold` (2) requests over the least loaded one *and* more than
`balance_rel_threshold` times as many, the request spills to the least loaded replica.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("round-robin", "least-loaded", "prefix-aware")

# Decisions, as the router's metrics label them.
ROUND_ROBIN = "round_robin"
LEAST_LOADED = "least_loaded"
PREFIX_AFFINITY = "prefix_affinity"
PREFIX_SPILL = "prefix_spill"

# Requests over the least loaded replica before prefix-aware spills (SGLang's router uses 64
# for GPU batches; 2 gave the lowest TTFT p99 in benchmarks/route_sim.py, docs/scale_out.md).
DEFAULT_BALANCE_ABS_THRESHOLD = 2.0
DEFAULT_BALANCE_REL_THRESHOLD = 1.5


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one healthy replica's load."""

    name: str
    in_flight: int = 0  # requests the router has sent it that have not finished
    waiting: float = 0.0  # tokenmill:num_requests_waiting, last scrape
    kv_usage: float = 0.0  # tokenmill:kv_cache_usage_perc (0..1), last scrape

    @property
    def load(self) -> float:
        """One number to compare replicas by: requests in flight plus those queued, with KV
        usage breaking ties (a replica near a full cache is about to queue or preempt)."""
        return self.in_flight + self.waiting + self.kv_usage


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str  # one of the decision names above


class Policy(Protocol):
    def choose(self, replicas: Sequence[ReplicaLoad], key: bytes | None) -> Decision:
        """`replicas`: the healthy ones (never empty); `key`: the prompt's prefix key."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, replicas: Sequence[ReplicaLoad], key: bytes | None) -> Decision:
        return Decision(replicas[next(self._counter) % len(replicas)].name, ROUND_ROBIN)


class LeastLoaded:
    def choose(self, replicas: Sequence[ReplicaLoad], key: bytes | None) -> Decision:
        return Decision(least_loaded(replicas).name, LEAST_LOADED)


class PrefixAware:
    def __init__(
        self,
        balance_abs_threshold: float = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
    ):
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._fallback = RoundRobin()

    def choose(self, replicas: Sequence[ReplicaLoad], key: bytes | None) -> Decision:
        if key is None:  # nothing to be affine to (e.g. a body that is not JSON)
            return self._fallback.choose(replicas, key)
        owner = max(replicas, key=lambda r: rendezvous_score(key, r.name))
        lightest = least_loaded(replicas)
        if self.overloaded(owner.load, lightest.load):
            return Decision(lightest.name, PREFIX_SPILL)
        return Decision(owner.name, PREFIX_AFFINITY)

    def overloaded(self, load: float, least: float) -> bool:
        return (
            load - least > self.balance_abs_threshold and load > self.balance_rel_threshold * least
        )


def least_loaded(replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
    """The replica with the least load; ties go to the first listed."""
    return min(replicas, key=lambda r: r.load)


def rendezvous_score(key: bytes, replica: str) -> int:
    digest = hashlib.blake2b(key + b"\0" + replica.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def make_policy(
    name: str,
    balance_abs_threshold: float = DEFAULT_BALANCE_ABS_THRESHOLD,
    balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-aware":
        return PrefixAware(balance_abs_threshold, balance_rel_threshold)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
