"""The routing simulator (benchmarks/route_sim.py) on a small fleet: its workload is what it
says, and its policies order as they must (affinity hits more, least-loaded balances more)."""

from __future__ import annotations

from collections import Counter

from benchmarks.route_sim import EventsDriven, Replica, Workload, make_requests, simulate

COEFFICIENTS = (0.01, 0.001, 0.001, 1e-7)


def test_workload_is_zipf_over_tenants_with_fixed_system_prompts() -> None:
    requests, systems = make_requests(Workload(num_tenants=50, num_requests=4000), rate=10.0)
    counts = Counter(r.tenant for r in requests)
    assert counts[0] > 2 * counts[1] * 0.8 and counts[0] > 10 * counts[20]  # ~1/k
    assert all(r.system == systems[r.tenant] for r in requests)
    assert all(1024 <= s <= 4096 for s in systems)
    assert abs(requests[-1].arrival / len(requests) - 0.1) < 0.01  # Poisson at 10/s


def test_prefix_aware_hits_more_and_least_loaded_balances_more() -> None:
    workload = Workload(num_tenants=40, num_requests=1500)
    requests, _ = make_requests(workload, rate=4.0)
    results = {
        policy: simulate(policy, requests, 8, 3 * 4096, COEFFICIENTS)
        for policy in ("round-robin", "least-loaded", "prefix-aware")
    }
    assert results["prefix-aware"]["hit_rate"] > 1.5 * results["round-robin"]["hit_rate"]
    assert results["prefix-aware"]["ttft_p50_s"] < results["round-robin"]["ttft_p50_s"]
    assert results["least-loaded"]["imbalance_p99"] <= results["round-robin"]["imbalance_p99"]


def test_routing_by_kv_events_hits_as_often_as_prefix_aware() -> None:
    """The events-fed router's index comes from the event streams, read late (0 s, and a
    second after each change); either way it hits as often as tokenmill's own router."""
    requests, _ = make_requests(Workload(num_tenants=40, num_requests=1500), rate=4.0)
    results = {
        policy: simulate(policy, requests, 8, 3 * 4096, COEFFICIENTS)
        for policy in ("round-robin", "prefix-aware")
    }
    for delay in (0.0, 1.0):
        events = simulate("kv-events", requests, 8, 3 * 4096, COEFFICIENTS, event_delay=delay)
        assert events["hit_rate"] > 1.5 * results["round-robin"]["hit_rate"]
        assert events["hit_rate"] >= 0.97 * results["prefix-aware"]["hit_rate"]


def test_a_replicas_events_replay_into_its_cache() -> None:
    replica = Replica("r", capacity=10)
    router = EventsDriven([replica], abs_threshold=2, delay=1.0)
    for now, tenant in enumerate([1, 2, 1, 3, 4, 2]):
        replica.lookup_and_insert(tenant, 3, float(now))
    router.read_events(5.0)  # the last change, at 5 s, is not delivered yet
    assert router.held["r"] == {1, 3, 4}
    router.read_events(6.0)
    assert router.held["r"] == set(replica.cache) == {3, 4, 2}
