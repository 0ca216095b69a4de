"""Prefill/decode disaggregation through the P2P connector, two engines in one process: the
prefill engine runs each prompt to one token and holds its KV, the decode engine pulls it over
a gloo pair and decodes. Greedy outputs equal one engine's for every architecture (with prefix
hits, salts and preemption on the decode side); transfers that fail end the request with an
error or recompute it; no block is ever leaked on either side."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

import pytest

from tokenmill import SamplingParams
from tokenmill.config import ConfigError
from tokenmill.core.sched.remote_kv import KV_TRANSFER_FAILED
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.kv_transfer.p2p import sender as sender_module
from tokenmill.kv_transfer.p2p.connector import P2pConnector
from tokenmill.outputs import RequestOutput
from tokenmill_testing.engines import make_llm

BLOCK_SIZE = 8
MAX_TOKENS = 6
DEADLINE_SECONDS = 60.0  # a bound on every loop here: a hang fails the test instead


def p2p_config(role: str, **extra) -> dict:
    return {
        "kv_connector": "P2pConnector",
        "kv_role": role,
        "kv_port": 0,
        "kv_load_failure_policy": extra.pop("policy", "fail"),
        "kv_connector_extra_config": {"timeout": 5, **extra},
    }


def make_engine(checkpoint, role: str | None = None, **kwargs) -> LLMEngine:
    extra = kwargs.pop("extra", {})
    if role is not None:
        kwargs["kv_transfer_config"] = p2p_config(role, **extra)
    kwargs.setdefault("num_kv_blocks", 64)
    return make_llm(checkpoint, block_size=BLOCK_SIZE, **kwargs).engine


def greedy(max_tokens: int = MAX_TOKENS, **extra_args) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args or None
    )


def run(engine: LLMEngine, *others: LLMEngine) -> dict[str, RequestOutput]:
    """Step `engine` (and `others`, whose transfers it may wait on) until its requests have
    finished (a prefill engine's KV may still be held); its outputs by request id."""
    finished: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + DEADLINE_SECONDS
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engines did not finish in time"
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        for other in others:
            other.step()
    return finished


def settle(*engines: LLMEngine) -> None:
    """Step the engines until no transfer is pending on any (bounded)."""
    deadline = time.monotonic() + DEADLINE_SECONDS
    while any(e.has_pending_kv_transfers() or e.has_unfinished_requests() for e in engines):
        assert time.monotonic() < deadline, "transfers still pending"
        for engine in engines:
            engine.step()


def all_blocks_free(engine: LLMEngine) -> bool:
    manager = engine.kv_cache_manager
    return manager.num_free_blocks == manager.num_blocks


@dataclass
class Pair:
    prefill: LLMEngine
    decode: LLMEngine
    params: dict[str, dict] = field(default_factory=dict)

    def prefill_all(self, prompts: dict[str, list[int]], salt: str | None = None) -> None:
        for request_id, prompt in prompts.items():
            transfer = {"do_remote_decode": True}
            self.prefill.add_request(
                request_id, prompt, greedy(1, kv_transfer_params=transfer), cache_salt=salt
            )
        for request_id, output in run(self.prefill).items():
            assert output.kv_transfer_params is not None
            self.params[request_id] = output.kv_transfer_params

    def decode_all(
        self,
        prompts: dict[str, list[int]],
        salt: str | None = None,
        max_tokens: int = MAX_TOKENS,
    ) -> dict[str, RequestOutput]:
        for request_id, prompt in prompts.items():
            params = greedy(max_tokens, kv_transfer_params=self.params[request_id])
            self.decode.add_request(request_id, prompt, params, cache_salt=salt)
        outputs = run(self.decode, self.prefill)
        settle(self.prefill, self.decode)
        return outputs

    def generate(self, prompts: dict[str, list[int]], **kwargs) -> dict[str, RequestOutput]:
        self.prefill_all(prompts, kwargs.get("salt"))
        return self.decode_all(prompts, **kwargs)

    def shutdown(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()


def make_pair(checkpoint, decode_kwargs: dict | None = None, **kwargs) -> Pair:
    extra = kwargs.pop("extra", {})
    prefill = make_engine(checkpoint, "kv_producer", extra=extra, **kwargs)
    decode = make_engine(
        checkpoint, "kv_consumer", extra=extra, **{**kwargs, **(decode_kwargs or {})}
    )
    return Pair(prefill, decode)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(11)
    base = [rng.randrange(10, 1000) for _ in range(37)]
    return {
        "a": base,
        "b": [*base, 5, 6, 7, 8, 9, 10, 11, 12, 13],  # extends "a": a prefix hit on decode
        "c": [rng.randrange(10, 1000) for _ in range(19)],
        "d": [rng.randrange(10, 1000) for _ in range(8)],  # one block: only 7 tokens to load
    }


def single_engine_tokens(checkpoint, prompts, max_tokens: int = MAX_TOKENS, **kwargs):
    engine = make_engine(checkpoint, **kwargs)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, greedy(max_tokens))
    return {r: o.outputs[0].token_ids for r, o in run(engine).items()}


def tokens(outputs: dict[str, RequestOutput]) -> dict[str, list[int]]:
    return {r: o.outputs[0].token_ids for r, o in outputs.items()}


@pytest.mark.parametrize(
    ("architecture", "kwargs"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("mistral", {"sliding_window": 16}),
        ("qwen2", {}),
        ("qwen3", {}),
    ],
)
def test_greedy_outputs_equal_one_engine_for_every_architecture(
    tiny_checkpoint, prompts, architecture: str, kwargs: dict
) -> None:
    checkpoint = tiny_checkpoint(architecture, **kwargs)
    expected = single_engine_tokens(checkpoint, prompts)
    pair = make_pair(checkpoint)
    try:
        first = {k: prompts[k] for k in ("a", "c", "d")}
        outputs = pair.generate(first)
        assert tokens(outputs) == {k: expected[k] for k in first}
        # Loaded, not computed: every prompt token but the last.
        assert {k: o.num_cached_tokens for k, o in outputs.items()} == {
            k: len(p) - 1 for k, p in first.items()
        }
        # "b" extends "a": the decode engine's own prefix cache holds a's full blocks now,
        # so it pulls only the rest.
        loaded_before = pair.decode.get_stats().kv_transfer.num_loaded_tokens
        outputs = pair.generate({"b": prompts["b"]})
        assert tokens(outputs) == {"b": expected["b"]}
        hit = (len(prompts["a"]) - 1) // BLOCK_SIZE * BLOCK_SIZE
        loaded = pair.decode.get_stats().kv_transfer.num_loaded_tokens - loaded_before
        assert loaded == len(prompts["b"]) - 1 - hit
        assert pair.decode.get_stats().scheduler.prefix_cache.hits >= hit
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
    finally:
        pair.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def expected(checkpoint, prompts) -> dict[str, list[int]]:
    return single_engine_tokens(checkpoint, prompts)


def test_preemption_on_the_decode_side_keeps_outputs(checkpoint, prompts) -> None:
    """Too few decode blocks for every request at once: some are preempted (recompute) after
    their KV arrived, and resume from the decode engine's own prefix cache."""
    max_tokens = 24
    reference = single_engine_tokens(checkpoint, prompts, max_tokens=max_tokens)
    pair = make_pair(checkpoint, decode_kwargs={"num_kv_blocks": 14})
    try:
        outputs = pair.generate(prompts, max_tokens=max_tokens)
        assert tokens(outputs) == reference
        assert pair.decode.get_stats().scheduler.num_preemptions > 0
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
    finally:
        pair.shutdown()


def test_salted_requests_round_trip_and_never_load_another_tenants_kv(
    checkpoint, prompts, expected
) -> None:
    pair = make_pair(checkpoint, extra={"kv_lease_duration": 1})
    one = {"a": prompts["a"]}
    try:
        outputs = pair.generate(one, salt="tenant-a")
        assert tokens(outputs) == {"a": expected["a"]}
        assert outputs["a"].num_cached_tokens == len(prompts["a"]) - 1
        # Tenant B presents tenant A's params: the digests differ, nothing is loaded; the
        # decode engine computes B's prompt itself (same tokens: the salt only isolates).
        pair.prefill_all(one, salt="tenant-a")
        outputs = pair.decode_all(one, salt="tenant-b")
        assert tokens(outputs) == {"a": expected["a"]}
        assert outputs["a"].num_cached_tokens == 0
        # B's params are never used, not even to release A's hold: its lease frees it.
        assert pair.prefill.get_stats().kv_transfer.num_expired_requests == 1
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
    finally:
        pair.shutdown()


def corrupt_in_transit(monkeypatch, index: int, from_chunk: int = 0):
    """Flip byte `index` of each chunk the producer sends, from its `from_chunk`th on, after
    the chunk's CRCs are taken (corrupted on the way); returns the real CRC function."""
    real = sender_module.block_crcs
    chunks = iter(range(1 << 30))

    def corrupt_after_checksum(payload):
        crcs = real(payload)
        if next(chunks) >= from_chunk:
            payload.view(-1)[index] ^= 0xFF
        return crcs

    monkeypatch.setattr(sender_module, "block_crcs", corrupt_after_checksum)
    return real


def test_a_corrupted_block_fails_the_request_and_frees_both_sides(
    checkpoint, prompts, expected, monkeypatch
) -> None:
    # A block of the second chunk (of one block each): the first is in the cache already.
    real = corrupt_in_transit(monkeypatch, -1, from_chunk=1)
    pair = make_pair(checkpoint, extra={"chunk_bytes": 1})
    try:
        outputs = pair.generate({"a": prompts["a"]})
        output = outputs["a"]
        assert output.outputs[0].finish_reason == "error" and not output.outputs[0].token_ids
        assert output.error is not None and output.error.code == KV_TRANSFER_FAILED
        assert "corrupted" in output.error.message
        assert pair.decode.get_stats().kv_transfer.num_failed_transfers == 1
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
        # Both keep serving: the next request (no longer corrupted) comes out right.
        monkeypatch.setattr(sender_module, "block_crcs", real)
        assert tokens(pair.generate({"c": prompts["c"]})) == {"c": expected["c"]}
    finally:
        pair.shutdown()


def test_with_the_recompute_policy_a_failed_load_is_computed_locally(
    checkpoint, prompts, expected, monkeypatch
) -> None:
    corrupt_in_transit(monkeypatch, 0)
    pair = make_pair(checkpoint, extra={"policy": "recompute"})
    try:
        outputs = pair.generate({"a": prompts["a"], "c": prompts["c"]})
        assert tokens(outputs) == {k: expected[k] for k in ("a", "c")}
        assert all(o.error is None for o in outputs.values())
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
    finally:
        pair.shutdown()


def test_a_transfer_that_times_out_fails_without_hanging(
    checkpoint, prompts, expected, monkeypatch
) -> None:
    """The producer stalls past the consumer's timeout before sending: the request ends
    with an error after about the timeout; the late send fails; both sides free."""
    real = sender_module.KVSender._claim

    def stalled(self, request_id, message):
        time.sleep(2.5)
        return real(self, request_id, message)

    monkeypatch.setattr(sender_module.KVSender, "_claim", stalled)
    pair = make_pair(checkpoint, extra={"timeout": 1})
    try:
        start = time.monotonic()
        outputs = pair.generate({"a": prompts["a"]})
        assert outputs["a"].error is not None and "in time" in outputs["a"].error.message
        assert time.monotonic() - start < 30
        monkeypatch.setattr(sender_module.KVSender, "_claim", real)
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
        assert tokens(pair.generate({"c": prompts["c"]})) == {"c": expected["c"]}  # reconnects
    finally:
        pair.shutdown()


def test_a_producer_dying_mid_transfer_fails_the_request(checkpoint, prompts, monkeypatch) -> None:
    """The producer's side of the pair breaks after the header went out (as a killed process
    would): the consumer sees the link break, the request ends with an error, and the
    producer's blocks come back (its send failed)."""

    def broken_send(self, tensor, tag):
        self.close()
        raise RuntimeError("injected: the producer died mid-transfer")

    monkeypatch.setattr(sender_module.PairGroup, "send", broken_send)
    pair = make_pair(checkpoint, extra={"timeout": 2})
    try:
        outputs = pair.generate({"a": prompts["a"]})
        assert outputs["a"].error is not None
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
    finally:
        pair.shutdown()


def test_held_kv_that_nobody_pulls_is_freed_after_its_lease(checkpoint, prompts) -> None:
    """The decode instance died (never pulls): the prefill engine gives the blocks back when
    the lease runs out, and keeps serving."""
    pair = make_pair(checkpoint, extra={"kv_lease_duration": 0.5})
    try:
        pair.prefill_all({"a": prompts["a"]})
        assert not all_blocks_free(pair.prefill)  # held for the consumer
        settle(pair.prefill)
        assert all_blocks_free(pair.prefill)
        assert pair.prefill.get_stats().kv_transfer.num_expired_requests == 1
    finally:
        pair.shutdown()


def test_a_decode_request_aborted_while_loading_frees_its_blocks(
    checkpoint, prompts, monkeypatch
) -> None:
    real = sender_module.KVSender._claim

    def slow(self, request_id, message):
        time.sleep(0.3)
        return real(self, request_id, message)

    monkeypatch.setattr(sender_module.KVSender, "_claim", slow)
    pair = make_pair(checkpoint)
    try:
        pair.prefill_all({"a": prompts["a"]})
        params = greedy(kv_transfer_params=pair.params["a"])
        pair.decode.add_request("a", prompts["a"], params)
        pair.decode.step()  # admitted: blocks allocated, the pull started
        assert not all_blocks_free(pair.decode)
        pair.decode.abort_request("a")
        settle(pair.prefill, pair.decode)
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
    finally:
        pair.shutdown()


def test_n_samples_each_pull_the_same_prompt(checkpoint, prompts, expected) -> None:
    pair = make_pair(checkpoint)
    try:
        transfer = {"do_remote_decode": True, "num_consumers": 3}
        pair.prefill.add_request("a", prompts["a"], greedy(1, kv_transfer_params=transfer))
        pair.params["a"] = run(pair.prefill)["a"].kv_transfer_params
        params = SamplingParams(
            n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
            extra_args={"kv_transfer_params": pair.params["a"]},
        )  # fmt: skip
        pair.decode.add_request("a", prompts["a"], params)
        output = run(pair.decode, pair.prefill)["a"]
        settle(pair.prefill, pair.decode)
        assert [c.token_ids for c in output.outputs] == [expected["a"]] * 3
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
    finally:
        pair.shutdown()


def test_bad_kv_transfer_params_are_rejected_when_added(checkpoint) -> None:
    decode = make_engine(checkpoint, "kv_consumer")
    try:
        bad = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "x"}
        with pytest.raises(ValueError, match="kv_transfer_params"):
            decode.add_request("x", [1, 2, 3], greedy(kv_transfer_params=bad))
        assert isinstance(decode.parts.kv_connectors.scheduler, P2pConnector)
        assert not decode.has_unfinished_requests()
    finally:
        decode.shutdown()


def test_a_transfer_in_chunks_with_a_paced_receiver(checkpoint, prompts, expected) -> None:
    """One block per chunk (each checked and written before the next), the receiver resting
    between chunks as long as it worked: the same outputs, every block written."""
    pair = make_pair(checkpoint, extra={"chunk_bytes": 1, "recv_duty_cycle": 0.5})
    try:
        assert pair.decode.parts.kv_connectors.worker.receiver.chunk_blocks == 1
        outputs = pair.generate({"a": prompts["a"], "b": prompts["b"]})
        assert tokens(outputs) == {k: expected[k] for k in ("a", "b")}
        assert outputs["a"].num_cached_tokens == len(prompts["a"]) - 1
        assert all_blocks_free(pair.prefill) and all_blocks_free(pair.decode)
    finally:
        pair.shutdown()


@pytest.mark.parametrize("cpus", [[], [10_000], ["0"], 0])
def test_recv_cpus_must_be_cpus_of_this_machine(checkpoint, cpus) -> None:
    with pytest.raises(ConfigError, match="recv_cpus must be a list of this machine's CPU"):
        make_engine(checkpoint, "kv_consumer", extra={"recv_cpus": cpus})


def test_the_receiver_runs_on_its_recv_cpus(checkpoint, prompts, expected) -> None:
    """The consumer's receiving thread pins itself to `recv_cpus` (here one CPU of the
    machine's); the transfer and its outputs are as without."""
    cpu = min(os.sched_getaffinity(0))
    pair = make_pair(checkpoint, decode_kwargs={}, extra={"recv_cpus": [cpu]})
    try:
        outputs = pair.generate({"a": prompts["a"]})
        assert tokens(outputs) == {"a": expected["a"]}
        links = list(pair.decode.parts.kv_connectors.worker.receiver.links.values())
        assert links and all(os.sched_getaffinity(link.thread.native_id) == {cpu} for link in links)
    finally:
        pair.shutdown()
