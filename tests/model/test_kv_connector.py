"""The storage KV connector end to end on a real checkpoint: outputs identical with and
without it, a prefix restored after a restart, tenants kept apart by cache_salt, corrupt
blocks recomputed, and the kv_role of each side."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kv_transfer.storage import SharedStorageConnector
from tokenmill.step.request import Request
from tokenmill_testing.engines import make_llm

BLOCK_SIZE = 8
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    base = [rng.randrange(10, 1000) for _ in range(37)]
    return [
        base,
        [*base, 5, 6, 7, 8],  # extends the first
        [rng.randrange(10, 1000) for _ in range(26)],  # unrelated
    ]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def storage_config(directory: Path, role: str = "kv_both") -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(directory)},
    }


def engine(checkpoint: str, directory: Path | None = None, role: str = "kv_both", **kwargs):
    if directory is not None:
        kwargs["kv_transfer_config"] = storage_config(directory, role)
    return make_llm(checkpoint, block_size=BLOCK_SIZE, **kwargs)


def generate(
    llm: LLM,
    prompts: list[list[int]],
    salt: str | None = None,
    params: SamplingParams | None = None,
) -> list:
    """Run `prompts` one after another (so each may find the ones before it stored)."""
    core = llm.engine
    results = []
    for index, prompt in enumerate(prompts):
        request_id = f"r{core.num_steps}-{index}"
        core.add_request(request_id, prompt, params or greedy(), cache_salt=salt)
        while core.has_unfinished_requests():
            for output in core.step():
                if output.finished:
                    results.append(output)
    return results


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def full_blocks(prompt: list[int]) -> int:
    """Tokens of the whole blocks a request may skip (never its last token)."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module", params=["auto", "fp8"])
def kv_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(checkpoint, prompts, kv_dtype) -> list[list[int]]:
    return token_ids(generate(engine(checkpoint, kv_cache_dtype=kv_dtype), prompts))


def test_outputs_identical_with_the_connector(
    checkpoint, prompts, kv_dtype, reference, tmp_path
) -> None:
    llm = engine(checkpoint, tmp_path, kv_cache_dtype=kv_dtype)
    assert token_ids(generate(llm, prompts)) == reference
    stats = llm.get_stats().kv_transfer
    assert stats is not None and stats.num_saved_blocks > 0
    spec = llm.engine.parts.kv_connectors.scheduler.context.kv_cache_spec
    assert spec.dtype == (torch.float32 if kv_dtype == "auto" else torch.float8_e4m3fn)
    assert stats.bytes_saved == stats.num_saved_blocks * spec.bytes_per_block
    assert stats.num_loaded_tokens == 0  # one engine: its own prefix cache serves the hits


def test_restart_serves_the_prefix_from_the_directory(
    checkpoint, prompts, kv_dtype, reference, tmp_path
) -> None:
    generate(engine(checkpoint, tmp_path, kv_cache_dtype=kv_dtype), prompts[:1])
    restarted = engine(checkpoint, tmp_path, kv_cache_dtype=kv_dtype)
    outputs = generate(restarted, prompts[:2])
    assert token_ids(outputs) == reference[:2]
    assert outputs[0].num_cached_tokens == full_blocks(prompts[0])  # loaded, not computed
    stats = restarted.get_stats()
    assert stats.kv_transfer.num_loaded_tokens == full_blocks(prompts[0])
    assert stats.kv_transfer.num_loaded_blocks == full_blocks(prompts[0]) // BLOCK_SIZE
    # The second prompt found the loaded blocks in the local prefix cache.
    assert outputs[1].num_cached_tokens == full_blocks(prompts[0])
    assert stats.scheduler.prefix_cache.hits == full_blocks(prompts[0])


def test_a_different_cache_salt_never_loads_another_tenants_blocks(
    checkpoint, prompts, tmp_path
) -> None:
    generate(engine(checkpoint, tmp_path), prompts[:1], salt="tenant-a")
    other = engine(checkpoint, tmp_path)
    assert generate(other, prompts[:1], salt="tenant-b")[0].num_cached_tokens == 0
    assert generate(other, prompts[:1])[0].num_cached_tokens == 0  # no salt: no match either
    assert other.get_stats().kv_transfer.num_loaded_tokens == 0
    same = engine(checkpoint, tmp_path)
    assert generate(same, prompts[:1], salt="tenant-a")[0].num_cached_tokens > 0


def block_path(llm: LLM, prompt: list[int], index: int) -> Path:
    core = llm.engine
    connector = core.parts.kv_connectors.scheduler
    assert isinstance(connector, SharedStorageConnector)
    request = Request("probe", prompt, greedy(), MAX_TOKENS)
    return connector.block_path(core.kv_cache_manager.block_hashes(request)[index])


def test_a_corrupt_block_is_detected_and_recomputed(
    checkpoint, prompts, kv_dtype, reference, tmp_path
) -> None:
    first = engine(checkpoint, tmp_path, kv_cache_dtype=kv_dtype)
    generate(first, prompts[:1])
    path = block_path(first, prompts[0], 1)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one payload byte flipped: the checksum no longer matches
    path.write_bytes(bytes(data))

    restarted = engine(checkpoint, tmp_path, kv_cache_dtype=kv_dtype)
    outputs = generate(restarted, prompts[:1])
    assert token_ids(outputs) == reference[:1]
    assert outputs[0].num_cached_tokens == BLOCK_SIZE  # block 0 loaded, block 1 on recomputed
    stats = restarted.get_stats().kv_transfer
    assert stats.num_corrupt_blocks == 1 and stats.num_loaded_blocks == 1
    # The recomputed block was stored again, intact: a third engine loads the whole prefix.
    third = engine(checkpoint, tmp_path, kv_cache_dtype=kv_dtype)
    assert generate(third, prompts[:1])[0].num_cached_tokens == full_blocks(prompts[0])


def test_a_truncated_block_file_is_not_used(checkpoint, prompts, reference, tmp_path) -> None:
    first = engine(checkpoint, tmp_path)
    generate(first, prompts[:1])
    path = block_path(first, prompts[0], 0)
    path.write_bytes(path.read_bytes()[:-100])
    restarted = engine(checkpoint, tmp_path)
    outputs = generate(restarted, prompts[:1])
    assert outputs[0].num_cached_tokens == 0
    assert token_ids(outputs) == reference[:1]


def test_roles_producer_saves_consumer_loads(checkpoint, prompts, tmp_path) -> None:
    producer = engine(checkpoint, tmp_path, role="kv_producer")
    generate(producer, prompts[:1])
    assert producer.get_stats().kv_transfer.num_saved_blocks > 0
    # A producer does not load what is stored...
    again = engine(checkpoint, tmp_path, role="kv_producer")
    assert generate(again, prompts[:1])[0].num_cached_tokens == 0
    # ...a consumer does, and stores nothing of its own.
    consumer = engine(checkpoint, tmp_path, role="kv_consumer")
    outputs = generate(consumer, prompts[:1] + prompts[2:])
    assert outputs[0].num_cached_tokens == full_blocks(prompts[0])
    assert consumer.get_stats().kv_transfer.num_saved_blocks == 0


def test_prompt_logprobs_requests_load_nothing(checkpoint, prompts, tmp_path) -> None:
    generate(engine(checkpoint, tmp_path), prompts[:1])
    restarted = engine(checkpoint, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    output = restarted.generate(prompts[:1], params, use_tqdm=False)[0]
    assert output.num_cached_tokens == 0
    assert len(output.prompt_logprobs) == len(prompts[0])


def test_outputs_identical_under_preemption(checkpoint, prompts, tmp_path) -> None:
    """Too few blocks for both long requests: one is preempted (recompute) and resumed while
    the connector loads and saves."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = token_ids(generate(engine(checkpoint), prompts, params=params))
    generate(engine(checkpoint, tmp_path), prompts[:1])
    llm = engine(checkpoint, tmp_path, num_kv_blocks=11, max_model_len=72)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.scheduler.num_preemptions > 0 and stats.kv_transfer.num_loaded_tokens > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize(
    ("architecture", "kwargs"),
    [("mistral", {"sliding_window": 16}), ("qwen2", {}), ("qwen3", {})],
)
def test_restart_restores_the_prefix_for_every_architecture(
    tiny_checkpoint, prompts, tmp_path, architecture: str, kwargs: dict
) -> None:
    """Biases (qwen2), q/k norms (qwen3), a sliding window shorter than the loaded prefix."""
    other = str(tiny_checkpoint(architecture, **kwargs))
    expected = token_ids(generate(engine(other), prompts[:1]))
    generate(engine(other, tmp_path), prompts[:1])
    outputs = generate(engine(other, tmp_path), prompts[:1])
    assert outputs[0].num_cached_tokens == full_blocks(prompts[0])
    assert token_ids(outputs) == expected


def test_the_connector_works_with_prefix_caching_off(checkpoint, prompts, tmp_path) -> None:
    """The block hashes are made for the connector even when the local cache keeps none."""
    expected = token_ids(generate(engine(checkpoint), prompts[:1]))
    generate(engine(checkpoint, tmp_path, enable_prefix_caching=False), prompts[:1])
    restarted = engine(checkpoint, tmp_path, enable_prefix_caching=False)
    outputs = generate(restarted, prompts[:1])
    assert outputs[0].num_cached_tokens == full_blocks(prompts[0])
    assert token_ids(outputs) == expected
    assert restarted.get_stats().scheduler.prefix_cache.queries == 0  # no local lookups
