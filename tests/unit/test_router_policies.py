"""Routing decisions: round-robin cycles, least-loaded picks the least loaded, prefix-aware
keeps a prefix on one replica, spreads prefixes, spills over the load threshold and moves
only the departed replica's prefixes."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tokenmill.entrypoints.router.balancing.policies import (
    LEAST_LOADED,
    PREFIX_AFFINITY,
    PREFIX_SPILL,
    LeastLoaded,
    PrefixAware,
    ReplicaLoad,
    RoundRobin,
    make_policy,
)
from tokenmill.entrypoints.router.balancing.prefix_key import prefix_key

REPLICAS = [ReplicaLoad(f"http://r{i}") for i in range(4)]


def test_round_robin_cycles_through_the_replicas() -> None:
    policy = RoundRobin()
    chosen = [policy.choose(REPLICAS, None).replica for _ in range(8)]
    assert chosen == [r.name for r in REPLICAS] * 2


def test_least_loaded_counts_in_flight_waiting_and_kv_usage() -> None:
    replicas = [
        ReplicaLoad("a", in_flight=3),
        ReplicaLoad("b", in_flight=1, waiting=1),
        ReplicaLoad("c", in_flight=1, waiting=1, kv_usage=0.5),
        ReplicaLoad("d", in_flight=2, waiting=4),
    ]
    decision = LeastLoaded().choose(replicas, b"k")
    assert (decision.replica, decision.reason) == ("b", LEAST_LOADED)


def test_prefix_aware_keeps_a_prefix_on_one_replica_and_spreads_prefixes() -> None:
    policy = PrefixAware()
    owners = {}
    for tenant in range(64):
        system = f"You are the assistant of tenant {tenant}. " * 40
        prompts = [system + f"question {q}" for q in range(5)]
        chosen = {
            policy.choose(REPLICAS, prefix_key("/v1/completions", _body(p))).replica
            for p in prompts
        }
        assert len(chosen) == 1, "one tenant's prompts went to several replicas"
        owners[tenant] = chosen.pop()
    counts = Counter(owners.values())
    assert set(counts) == {r.name for r in REPLICAS}
    assert max(counts.values()) <= 2.5 * 64 / len(REPLICAS)  # rendezvous spreads keys


def test_prefix_aware_spills_to_the_least_loaded_only_over_both_thresholds() -> None:
    policy = PrefixAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    key = b"some prefix"
    owner = policy.choose(REPLICAS, key).replica

    def loads(owner_load: int, other_load: int) -> list[ReplicaLoad]:
        return [
            ReplicaLoad(r.name, in_flight=owner_load if r.name == owner else other_load)
            for r in REPLICAS
        ]

    # 4 over the least loaded is not over the absolute threshold: affinity wins.
    assert policy.choose(loads(6, 2), key).reason == PREFIX_AFFINITY
    # 5 over but only 1.25x as many: still affinity.
    assert policy.choose(loads(25, 20), key).reason == PREFIX_AFFINITY
    # 5 over and 3.5x as many: spills, to the least loaded.
    lightest = next(r.name for r in REPLICAS if r.name != owner)
    spilled = [
        ReplicaLoad(r.name, in_flight={owner: 7, lightest: 2}.get(r.name, 3)) for r in REPLICAS
    ]
    decision = policy.choose(spilled, key)
    assert (decision.replica, decision.reason) == (lightest, PREFIX_SPILL)


def test_a_departed_replica_moves_only_its_own_prefixes() -> None:
    policy = PrefixAware()
    keys = [f"tenant {i}".encode() for i in range(200)]
    before = {k: policy.choose(REPLICAS, k).replica for k in keys}
    gone = REPLICAS[1].name
    after = {k: policy.choose([r for r in REPLICAS if r.name != gone], k).replica for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone for k in moved)


def test_prefix_keys_read_completions_token_ids_and_chat_messages() -> None:
    long = "x" * 600
    assert prefix_key("/v1/completions", _body(long + "a")) == prefix_key(
        "/v1/completions", _body(long + "b")
    )
    assert prefix_key("/v1/completions", _body("a" + long)) != prefix_key(
        "/v1/completions", _body("b" + long)
    )
    ids = b'{"prompt": [1, 2, 3]}'
    assert prefix_key("/v1/completions", ids) == b"i1,2,3"
    chat = b'{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user"}]}'
    assert prefix_key("/v1/chat/completions", chat).startswith(b"c<system>Be brief.")
    assert prefix_key("/v1/completions", b"not json") is None
    salted = json.dumps({"prompt": long, "cache_salt": "tenant-a"}).encode()
    assert prefix_key("/v1/completions", salted) != prefix_key("/v1/completions", _body(long))


def test_prefix_aware_without_a_key_falls_back_to_round_robin() -> None:
    policy = PrefixAware()
    assert len({policy.choose(REPLICAS, None).replica for _ in range(4)}) == 4


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="round-robin, least-loaded, prefix-aware"):
        make_policy("random")


def _body(prompt: str) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt}).encode()
