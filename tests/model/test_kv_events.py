"""`--kv-events-config`: the KV cache events a router subscribes to, read as vLLM's subscriber
reads them (its msgspec structs, declared here from vLLM's schema), must replay into exactly
the prefix cache's contents: stored blocks found, evicted ones gone, a reset clearing all."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tokenmill import SamplingParams
from tokenmill.core.kv.events import external_block_hash
from tokenmill_testing.engines import make_llm

zmq = pytest.importorskip("zmq", reason="the fleet extra (pyzmq) is not installed")
msgspec = pytest.importorskip("msgspec", reason="the fleet extra (msgspec) is not installed")


# vLLM's event types, as its examples/online_serving/kv_events_subscriber.py declares them.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


BLOCK = 8


def receive(sub: Any, decoder: Any, seqs: list[int]) -> list[Any]:
    """Every batch published so far (the publisher's thread sends within milliseconds)."""
    events = []
    while sub.poll(300):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        seqs.append(int.from_bytes(seq, "big"))
        events.extend(decoder.decode(payload).events)
    return events


def test_events_replay_into_the_prefix_cache(tiny_checkpoint, tmp_path) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    config["replay_endpoint"] = f"ipc://{tmp_path}/kv-replay"
    llm = make_llm(
        tiny_checkpoint("llama"),
        block_size=BLOCK,
        num_kv_blocks=24,  # small: later prompts evict earlier ones' blocks
        kv_events_config={**config, "topic": "kv"},
    )
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    pool = llm.engine.kv_cache_manager.block_pool
    rng = random.Random(3)
    base = [rng.randrange(10, 1000) for _ in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    held: set[int] = set()
    seqs: list[int] = []
    prompts_by_hash: dict[int, list[int]] = {}
    kinds = set()
    stored_first = None
    other = [rng.randrange(10, 1000) for _ in range(60)]
    # Three prompts of 8 blocks each need all 24: the first two waves' cached blocks go.
    waves = [[base], [[*base, 1, 2, 3]], [other, [*other[:40], *base[:20]], [1, *other[1:]]]]
    for wave in waves:
        llm.generate(wave, params, use_tqdm=False)
        for event in receive(sub, decoder, seqs):
            kinds.add(type(event).__name__)
            if isinstance(event, BlockStored):
                stored_first = stored_first or event
                assert event.block_size == BLOCK and event.medium == "CPU"
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                assert event.parent_block_hash is None or event.parent_block_hash in held
                for i, h in enumerate(event.block_hashes):
                    prompts_by_hash[h] = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= held
                held.difference_update(event.block_hashes)
        assert held == {external_block_hash(h) for h in pool.cached_blocks}
    assert kinds == {"BlockStored", "BlockRemoved"}
    assert seqs == list(range(len(seqs)))  # one sequence, no gaps
    # The first prompt's blocks were stored with its tokens, chained from its start.
    first = [prompts_by_hash[h] for h in stored_first.block_hashes]
    assert stored_first.parent_block_hash is None
    assert [t for block in first for t in block] == base[: BLOCK * len(first)]
    # A subscriber that missed batches asks the replay socket from a sequence number on.
    replay = context.socket(zmq.DEALER)
    replay.connect(config["replay_endpoint"])
    replay.send_multipart((b"", (2).to_bytes(8, "big")))
    replayed = []
    while True:
        assert replay.poll(5000)
        _, seq, payload = replay.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        replayed.append(int.from_bytes(seq, "big"))
        decoder.decode(payload)
    assert replayed == seqs[2:]
    replay.close(linger=0)
    llm.engine.reset_prefix_cache()
    llm.generate([[5, 6, 7]], params, use_tqdm=False)  # a step publishes the reset
    events = receive(sub, decoder, seqs)
    assert isinstance(events[0], AllBlocksCleared) and not pool.cached_blocks
    llm.engine.shutdown()
    sub.close(linger=0)
    context.term()


def test_kv_events_config_is_checked() -> None:
    from tokenmill.config import ConfigError, KVEventsConfig

    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publishes is False
    with pytest.raises(ConfigError, match="publisher"):
        KVEventsConfig.parse('{"publisher": "nats"}')
    with pytest.raises(ConfigError, match="unknown kv_events_config keys"):
        KVEventsConfig.parse('{"port": 5557}')


def test_data_parallel_replicas_with_kv_events_are_refused(capsys) -> None:
    from tokenmill.entrypoints.cli import main

    events = '{"enable_kv_cache_events": true, "publisher": "zmq"}'
    argv = ["serve", "--data-parallel-size", "2", "--kv-events-config", events, "--port", "0"]
    assert main(argv) == 2
    assert "--kv-events-config with --data-parallel-size" in capsys.readouterr().err
