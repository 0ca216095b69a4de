"""The KV connector seam and its pieces without a model: the config and its flag, the
registry, the block file format, and how the scheduler calls a connector."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from tokenmill.config import ConfigError, EngineConfig, KVTransferConfig, SpeculativeConfig
from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.sched.output_applier import OutputApplier
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
)
from tokenmill.kv_transfer.block_file import (
    BlockLayout,
    CorruptBlockError,
    read_block,
    write_block,
)
from tokenmill.kv_transfer.factory import create_connector, create_connector_pair
from tokenmill.kv_transfer.p2p.connector import P2pConnector
from tokenmill.kv_transfer.p2p.params import RemotePrefill
from tokenmill.kv_transfer.storage import SharedStorageConnector, StorageConnectorMetadata
from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.metrics.prometheus import EngineMetrics
from tokenmill.metrics.stats import EngineStats, KVTransferStats, SchedulerStats
from tokenmill.metrics.stats_logger import format_stats_line
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.request import Request, RequestStatus
from tokenmill.step.runner_output import KVConnectorOutput, ModelRunnerOutput
from tokenmill.step.scheduler_output import SchedulerOutput

STORAGE = {
    "kv_connector": "SharedStorageConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/tmp/x"},
}


# ---- config --------------------------------------------------------------------------------


def test_kv_transfer_config_parses_vllm_fields() -> None:
    config = KVTransferConfig.parse(
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer", '
        '"kv_connector_extra_config": {"shared_storage_path": "/d"}}'
    )
    assert config is not None and config.is_kv_consumer and not config.is_kv_producer
    assert config.kv_connector_extra_config == {"shared_storage_path": "/d"}
    assert EngineConfig(kv_transfer_config=STORAGE).kv_transfer_config == KVTransferConfig(
        **STORAGE
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"kv_role": "kv_both"}, "needs a kv_connector"),
        ({**STORAGE, "kv_buffer_device": "cuda"}, "unknown kv_transfer_config keys"),
        ({**STORAGE, "kv_load_failure_policy": "retry"}, "kv_load_failure_policy must be"),
        ({**STORAGE, "kv_port": 70000}, "kv_port must be a port number"),
        ({**STORAGE, "kv_role": "kv_leader"}, "kv_role must be one of"),
        ({**STORAGE, "kv_connector_extra_config": []}, "must be a JSON object"),
    ],
)
def test_bad_kv_transfer_configs_are_rejected(value, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KVTransferConfig.parse(value)


def test_unsupported_combinations_are_rejected() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size 1"):
        EngineConfig(kv_transfer_config=STORAGE, tensor_parallel_size=2)
    eagle = SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="only ngram and suffix"):
        EngineConfig(kv_transfer_config=STORAGE, speculative_config=eagle)


def test_the_flag_takes_json() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-transfer-config", '{"kv_connector": "SharedStorageConnector"}'])
    config = engine_config_from_args(args).kv_transfer_config
    assert config is not None and config.kv_role == "kv_both"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-transfer-config", '{"kv_role": "kv_both"}'])


# ---- registry ------------------------------------------------------------------------------


def context(block_size: int = 4, dtype: torch.dtype = torch.float32) -> KVConnectorContext:
    spec = KVCacheSpec(num_layers=2, block_size=block_size, num_kv_heads=2, head_dim=4, dtype=dtype)
    return KVConnectorContext(spec, "f" * 64, KVCacheManager(8, block_size).block_hashes)


def test_unknown_connectors_and_missing_paths_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown kv_connector 'Nope'"):
        create_connector(
            KVTransferConfig(kv_connector="Nope"), KVConnectorRole.SCHEDULER, context()
        )
    with pytest.raises(ConfigError, match="shared_storage_path"):
        create_connector(
            KVTransferConfig(kv_connector="SharedStorageConnector"),
            KVConnectorRole.WORKER,
            context(),
        )


# ---- block files ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_block_files_round_trip_and_catch_corruption(tmp_path: Path, dtype) -> None:
    layout = BlockLayout((2, 2, 4, 2, 4 * dtype.itemsize), str(dtype))
    payload = torch.randint(0, 256, layout.shape, dtype=torch.uint8)
    path = tmp_path / "block.kv"
    write_block(path, payload, layout)
    assert torch.equal(read_block(path, layout), payload)
    assert not list(tmp_path.glob(".*"))  # the temporary file was renamed into place

    other = BlockLayout((2, 2, 8, 2, 4 * dtype.itemsize), str(dtype))
    with pytest.raises(CorruptBlockError, match="another KV layout"):
        read_block(path, other)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlockError, match="checksum"):
        read_block(path, layout)
    path.write_bytes(bytes(data[:-3]))
    with pytest.raises(CorruptBlockError, match="payload bytes"):
        read_block(path, layout)
    path.write_bytes(b"garbage\n")
    with pytest.raises(CorruptBlockError, match="not a tokenmill KV block"):
        read_block(path, layout)
    with pytest.raises(FileNotFoundError):
        read_block(tmp_path / "missing.kv", layout)


# ---- the scheduler's hooks -----------------------------------------------------------------


class RecordingConnector(KVConnectorBase):
    """Offers `num_external` tokens for every request, records what the scheduler tells it."""

    def __init__(self, num_external: int) -> None:
        super().__init__(KVTransferConfig(kv_connector="fake"), KVConnectorRole.SCHEDULER, None)
        self.num_external = num_external
        self.allocated: list[tuple[str, list[int], int]] = []
        self.finished: list[str] = []
        self.metas = 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return self.num_external, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        self.allocated.append((request.sample_id, list(block_ids), num_external_tokens))

    def build_connector_meta(
        self,
        scheduler_output: SchedulerOutput,
        requests: Mapping[str, Request],
        block_ids: Callable[[str], list[int]],
    ) -> KVConnectorMetadata:
        self.metas += 1
        return KVConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]):
        self.finished.append(request.sample_id)
        return False, None

    def start_load_kv(self) -> None: ...

    def wait_for_save(self) -> None: ...


def make_scheduler(connector: KVConnectorBase | None) -> Scheduler:
    return Scheduler(
        KVCacheManager(32, 4),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        kv_connector=connector,
    )


def request(request_id: str, num_prompt: int = 13) -> Request:
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    return Request(request_id, list(range(10, 10 + num_prompt)), params, max_tokens=2)


def test_external_tokens_are_computed_and_allocated() -> None:
    connector = RecordingConnector(num_external=8)
    scheduler = make_scheduler(connector)
    scheduler.add_request(request("a"))
    output = scheduler.schedule()
    assert isinstance(output.kv_connector_metadata, KVConnectorMetadata)
    assert output.num_scheduled_tokens == {"a": 13 - 8}  # only the rest is computed
    (new,) = output.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and len(new.block_ids) == 4  # 13 tokens, blocks of 4
    assert connector.allocated == [("a", new.block_ids, 8)]
    assert scheduler.requests["a"].num_cached_tokens == 8
    OutputApplier(scheduler).update_from_output(output, ModelRunnerOutput(["a"], [[1]]))
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert connector.finished == ["a"]


def test_without_a_connector_nothing_changes() -> None:
    scheduler = make_scheduler(None)
    scheduler.add_request(request("a"))
    output = scheduler.schedule()
    assert output.kv_connector_metadata is None
    assert output.num_scheduled_tokens == {"a": 13}


# ---- metrics -------------------------------------------------------------------------------


def engine_stats(kv_transfer: KVTransferStats | None) -> EngineStats:
    scheduler = SchedulerStats(0, 0, 0, 0, 0, 1)
    return EngineStats(scheduler, 0, 0, 0, kv_transfer=kv_transfer)


def test_prometheus_counts_connector_loads_and_saves() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m")
    metrics.record_stats(engine_stats(None))
    assert b"kv_connector" not in generate_latest(registry)  # no connector: no families
    metrics.record_stats(engine_stats(KVTransferStats(num_loaded_tokens=16, bytes_loaded=100)))
    metrics.record_stats(
        engine_stats(KVTransferStats(num_loaded_tokens=48, bytes_loaded=300, num_saved_blocks=2))
    )

    def value(name: str) -> float | None:
        return registry.get_sample_value(f"tokenmill:{name}_total", {"model_name": "m"})

    assert value("kv_connector_loaded_tokens") == 48
    assert value("kv_connector_loaded_bytes") == 300
    assert value("kv_connector_saved_blocks") == 2
    assert value("kv_connector_corrupt_blocks") == 0


# ---- the storage connector's halves, on fake caches --------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_storage_round_trip_between_halves(tmp_path: Path, dtype) -> None:
    config = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    ctx = context(dtype=dtype)
    scheduler_half = create_connector(config, KVConnectorRole.SCHEDULER, ctx)
    worker_half = create_connector(config, KVConnectorRole.WORKER, ctx)
    assert isinstance(scheduler_half, SharedStorageConnector)
    caches = [torch.randn(2, 8, 4, 2, 4).to(dtype) for _ in range(ctx.kv_cache_spec.num_layers)]
    worker_half.register_kv_caches(caches)
    probe = request("a", num_prompt=12)  # three full blocks; the last token is computed
    hashes = ctx.block_hashes(probe)
    worker_half.bind_connector_metadata(
        StorageConnectorMetadata(saves=[(5, hashes[0]), (6, hashes[1]), (7, hashes[2])])
    )
    worker_half.wait_for_save()
    assert worker_half.stats().num_saved_blocks == 3

    assert scheduler_half.get_num_new_matched_tokens(probe, 0) == (8, False)
    assert scheduler_half.get_num_new_matched_tokens(probe, 4) == (4, False)  # after a local hit
    for path in scheduler_half.directory.iterdir():
        path.unlink()
    # Asked again with the same local hit (a request waiting for blocks): not read again.
    assert scheduler_half.get_num_new_matched_tokens(probe, 4) == (4, False)
    assert scheduler_half.get_num_new_matched_tokens(probe, 0) == (0, False)  # a new match: gone
    assert scheduler_half.stats().num_corrupt_blocks == 0

    worker_half.wait_for_save()  # the files are written again
    assert scheduler_half.get_num_new_matched_tokens(probe, 0) == (8, False)
    scheduler_half.update_state_after_alloc(probe, [1, 2, 3, 4], 8)
    metadata = scheduler_half.build_connector_meta(SchedulerOutput([], [], {}, 0), {}, lambda _: [])
    worker_half.bind_connector_metadata(metadata)
    worker_half.start_load_kv()
    for cache in caches:
        as_bytes = cache.view(torch.uint8)
        assert torch.equal(as_bytes[:, 1], as_bytes[:, 5])
        assert torch.equal(as_bytes[:, 2], as_bytes[:, 6])
        assert not torch.equal(as_bytes[:, 3], as_bytes[:, 7])  # not loaded
    assert scheduler_half.stats().num_loaded_tokens == 8


def test_the_pair_names_its_halves_and_sums_their_stats(tmp_path: Path) -> None:
    config = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    ctx = context()
    pair = create_connector_pair(config, ctx)
    assert (pair.scheduler.role, pair.worker.role) == (
        KVConnectorRole.SCHEDULER,
        KVConnectorRole.WORKER,
    )
    pair.worker.register_kv_caches([torch.randn(2, 8, 4, 2, 4) for _ in range(2)])
    probe = request("a", num_prompt=12)
    hashes = ctx.block_hashes(probe)
    pair.worker.bind_connector_metadata(StorageConnectorMetadata(saves=[(5, hashes[0])]))
    pair.worker.wait_for_save()
    assert pair.scheduler.get_num_new_matched_tokens(probe, 0) == (4, False)
    pair.scheduler.update_state_after_alloc(probe, [1], 4)
    stats = pair.stats()
    assert (stats.num_saved_blocks, stats.num_loaded_tokens) == (1, 4)  # one from each half
    pair.shutdown()


def test_the_stats_line_shows_the_intervals_loads_and_saves() -> None:
    before = engine_stats(KVTransferStats(num_loaded_tokens=16, num_saved_blocks=1))
    now = engine_stats(KVTransferStats(num_loaded_tokens=48, num_saved_blocks=3))
    assert "KV connector: 32 tokens loaded, 2 blocks saved" in format_stats_line(now, before, 1.0)
    assert "KV connector" not in format_stats_line(now, now, 1.0)  # nothing this interval
    assert "KV connector" not in format_stats_line(engine_stats(None), engine_stats(None), 1.0)


# ---- asynchronous loads and held blocks (core/sched/remote_kv.py) -------------------------------


class AsyncConnector(RecordingConnector):
    """Offers `num_external` tokens asynchronously; holds finished requests' blocks."""

    def __init__(self, num_external: int, policy: str = "fail") -> None:
        super().__init__(num_external)
        self.config = KVTransferConfig(kv_connector="fake", kv_load_failure_policy=policy)
        self.loading: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if request.num_output_tokens or request.sample_id in self.finished:
            return 0, False
        return self.num_external, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens:
            self.loading.add(request.sample_id)

    def request_finished(self, request: Request, block_ids: list[int]):
        self.finished.append(request.sample_id)
        if request.sample_id in self.loading:
            return True, None
        if request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            return True, {"where": "here"}  # a send to another engine
        return False, None

    def update_connector_output(self, output) -> None:
        self.loading -= output.finished_recving | set(output.failed_recving)


def step(scheduler: Scheduler, sampled: dict[str, list[int]], transfers=None):
    output = scheduler.schedule()
    rows = [r for r in output.num_scheduled_tokens if r in sampled]
    runner = ModelRunnerOutput(rows, [sampled[r] for r in rows])
    runner.kv_connector_output = transfers
    return output, OutputApplier(scheduler).update_from_output(output, runner)


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.num_free_blocks


def has_pending_kv_transfers(scheduler: Scheduler) -> bool:
    return scheduler.remote_kv is not None and scheduler.remote_kv.has_pending


def test_an_asynchronous_load_waits_off_the_step_then_computes_the_rest() -> None:
    connector = AsyncConnector(num_external=12)
    scheduler = make_scheduler(connector)
    scheduler.add_request(request("a"))
    output, _ = step(scheduler, {})
    assert output.num_scheduled_tokens == {}  # admitted with blocks, waiting for its KV
    assert connector.allocated == [("a", connector.allocated[0][1], 12)]
    assert len(connector.allocated[0][1]) == 3  # 12 tokens in blocks of 4
    assert scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert has_pending_kv_transfers(scheduler) and not scheduler.running
    output, _ = step(scheduler, {}, KVConnectorOutput(finished_recving={"a"}))
    output, outputs = step(scheduler, {"a": [7]})
    assert output.num_scheduled_tokens == {"a": 1}  # only the last prompt token
    (new,) = output.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and len(new.block_ids) == 4
    assert outputs[0].new_token_ids == [7]
    assert scheduler.requests["a"].num_cached_tokens == 12


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_load_ends_the_request_or_computes_its_prompt(policy: str) -> None:
    connector = AsyncConnector(num_external=12, policy=policy)
    scheduler = make_scheduler(connector)
    scheduler.add_request(request("a"))
    step(scheduler, {})
    output, outputs = step(scheduler, {}, KVConnectorOutput(failed_recving={"a": "lost"}))
    if policy == "fail":
        (ended,) = outputs
        assert ended.finish_reason == "error" and ended.error.code == "kv_transfer_failed"
        assert "lost" in ended.error.message
        assert free_blocks(scheduler) == 32 and not scheduler.has_unfinished_requests()
    else:
        assert outputs == []
        output, _ = step(scheduler, {"a": [7]})
        assert output.num_scheduled_tokens == {"a": 13}  # computes the whole prompt itself


def test_finished_requests_blocks_are_held_until_their_send_ends() -> None:
    connector = AsyncConnector(num_external=0)
    connector.get_num_new_matched_tokens = lambda request, num: (0, False)
    scheduler = make_scheduler(connector)
    scheduler.add_request(request("a", num_prompt=8))
    step(scheduler, {"a": [7]})
    _, outputs = step(scheduler, {"a": [8]})  # max_tokens 2: finished
    assert outputs[0].finish_reason == "length"
    assert outputs[0].kv_transfer_params == {"where": "here"}
    assert free_blocks(scheduler) < 32 and has_pending_kv_transfers(scheduler)
    assert scheduler.has_request("a")  # its id is in use: its blocks are still its own
    step(scheduler, {}, KVConnectorOutput(finished_sending={"a"}))
    assert free_blocks(scheduler) == 32 and not has_pending_kv_transfers(scheduler)


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends() -> None:
    connector = AsyncConnector(num_external=12)
    scheduler = make_scheduler(connector)
    scheduler.add_request(request("a"))
    step(scheduler, {})
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert free_blocks(scheduler) == 29  # a transfer is still writing its three blocks
    step(scheduler, {}, KVConnectorOutput(finished_recving={"a"}))
    assert free_blocks(scheduler) == 32 and not has_pending_kv_transfers(scheduler)


def test_disaggregate_receives_on_the_prefill_cpus_unless_told_otherwise() -> None:
    from tokenmill.entrypoints.router.launching.serve_disaggregated import kv_transfer_configs

    producer, consumer = (json.loads(c) for c in kv_transfer_configs(9000, None, frozenset({0})))
    assert producer["kv_role"] == "kv_producer" and producer["kv_port"] == 9000
    assert "kv_connector_extra_config" not in producer
    assert consumer["kv_connector_extra_config"] == {"recv_cpus": [0]}
    given = KVTransferConfig.parse(
        {
            "kv_connector": "P2pConnector",
            "kv_connector_extra_config": {"recv_cpus": [1], "timeout": 5},
        }
    )
    producer, consumer = (json.loads(c) for c in kv_transfer_configs(9000, given, frozenset({0})))
    assert consumer["kv_connector_extra_config"] == {"recv_cpus": [1], "timeout": 5}
    assert producer["kv_connector_extra_config"] == {"recv_cpus": [1], "timeout": 5}


def test_a_request_holding_loaded_kv_is_admitted_before_one_that_cannot_fit() -> None:
    """`x`, preempted for memory after `y`'s KV arrived, lands ahead of `y` at the head of
    the queue and needs more blocks than `y` leaves free. `y` holds its loaded blocks, so
    it must go first (it needs one more block, and its blocks only come back once it has
    run); admitting strictly in queue order would wait on `x` for ever."""
    connector = AsyncConnector(num_external=8)
    remote_ids = {"y"}
    plain = connector.get_num_new_matched_tokens
    connector.get_num_new_matched_tokens = lambda r, n: (
        plain(r, n) if r.sample_id in remote_ids else (0, False)
    )
    scheduler = Scheduler(
        KVCacheManager(8, 4),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        kv_connector=connector,
    )
    x = Request("x", list(range(10, 27)), SamplingParams(max_tokens=12, ignore_eos=True), 12)
    scheduler.add_request(x)  # 17 prompt tokens: 5 of the 8 blocks
    step(scheduler, {"x": [7]})
    y = Request("y", list(range(100, 109)), SamplingParams(max_tokens=2, ignore_eos=True), 2)
    scheduler.add_request(y)  # 8 of its 9 prompt tokens loaded into 2 blocks
    step(scheduler, {"x": [7]})
    step(scheduler, {"x": [7]})
    step(scheduler, {"x": [7]}, KVConnectorOutput(finished_recving={"y"}))
    for _ in range(40):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, {"x": [7], "y": [7]}, KVConnectorOutput(finished_sending={"x", "y"}))
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_preemptions >= 1  # `x` did land ahead of `y` holding its blocks
    assert free_blocks(scheduler) == 8


def test_a_refused_requests_params_release_the_producers_hold() -> None:
    """A decode instance that refuses a request (bad input) before its scheduler saw it
    releases the hold its params name: a pull of no blocks in the next step's metadata."""
    remote = RemotePrefill("prefill-0", "127.0.0.1", 9000, "req-7", 40, "digest")
    consumer = P2pConnector(
        KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_consumer"),
        KVConnectorRole.SCHEDULER,
        context(),
    )
    consumer.request_refused({"temperature": 0})  # no remote prefill: nothing to release
    consumer.request_refused({"do_remote_prefill": True, "remote_port": "x"})  # malformed
    assert not consumer.has_pending_transfers()
    consumer.request_refused(remote.as_params())
    assert consumer.has_pending_transfers()
    (job,) = consumer.build_connector_meta(SchedulerOutput([], [], {}, 0), {}, lambda _: []).pulls
    assert job.remote == remote and job.block_ids == [] and job.first_block == 0
    producer = P2pConnector(
        KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_producer"),
        KVConnectorRole.SCHEDULER,
        context(),
    )
    producer.request_refused(remote.as_params())  # a producer pulls nothing
    assert not producer.has_pending_transfers()
