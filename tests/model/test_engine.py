"""Engine behaviour seen from the offline API: samples, stops, aborts, chat, streaming deltas,
and bad input rejected without disturbing other requests."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.assembly import EngineParts
from tokenmill.sampling_params import InvalidRequestError, RequestOutputKind

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def llm(random_llm: LLM) -> LLM:
    return random_llm


def greedy(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 16)
    return SamplingParams(temperature=0.0, ignore_eos=True, **kwargs)


def test_n_samples_differ_and_reproduce_with_a_seed(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    first = llm.generate(PROMPT, params, use_tqdm=False)[0]
    again = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) == 3
    assert samples == [tuple(c.token_ids) for c in again.outputs]


def test_stop_string_truncates_text_and_ends_the_request(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(max_tokens=20), use_tqdm=False)[0].outputs[0]
    stop = full.text[8:11]
    assert stop.strip(), f"pick a visible stop string from {full.text!r}"
    cut = llm.generate(PROMPT, greedy(max_tokens=20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids)
    kept = llm.generate(
        PROMPT, greedy(max_tokens=20, stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_end_the_request_after_that_token(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    stop_token = full.token_ids[4]
    first_at = full.token_ids.index(stop_token)
    out = llm.generate(PROMPT, greedy(stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: first_at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)


def test_eos_stops_unless_ignored_and_not_before_min_tokens(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    eos = full.token_ids[3]
    first_at = full.token_ids.index(eos)
    saved = llm.engine.intake.eos_token_ids  # the stop tokens requests are resolved with
    llm.engine.intake.eos_token_ids = {eos}
    try:
        stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        ignored = llm.generate(PROMPT, greedy(), use_tqdm=False)
        late = llm.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=16, min_tokens=12), use_tqdm=False
        )
    finally:
        llm.engine.intake.eos_token_ids = saved
    assert stopped[0].outputs[0].token_ids == full.token_ids[: first_at + 1]
    assert stopped[0].outputs[0].finish_reason == "stop"
    assert ignored[0].outputs[0].token_ids == full.token_ids
    late_ids = late[0].outputs[0].token_ids
    assert len(late_ids) >= 12
    assert eos not in late_ids[: 12 - 1] or late_ids.index(eos) >= 11


def test_max_tokens_caps_output_with_finish_reason_length(llm: LLM) -> None:
    out = llm.generate(PROMPT, greedy(max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    empty = llm.generate(PROMPT, greedy(max_tokens=0), use_tqdm=False)[0].outputs[0]
    assert empty.token_ids == [] and empty.text == "" and empty.finish_reason == "length"


def test_prompt_logprobs_with_no_output_score_the_prompt(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.encode(PROMPT)
    out = llm.generate(PROMPT, greedy(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == []
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt_ids)
    for token_id, position in zip(prompt_ids[1:], out.prompt_logprobs[1:]):
        assert token_id in position and position[token_id].logprob <= 0.0


def test_streaming_deltas_concatenate_to_the_final_text(llm: LLM) -> None:
    engine = llm.engine
    params = greedy(max_tokens=24, output_kind=RequestOutputKind.DELTA)
    engine.add_request("stream", PROMPT, params)
    text, token_ids = "", []
    while engine.has_unfinished_requests():
        for output in engine.step():
            text += output.outputs[0].text
            token_ids += output.outputs[0].token_ids
    final = llm.generate(PROMPT, greedy(max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert (text, token_ids) == (final.text, final.token_ids)


def test_abort_frees_blocks_and_other_requests_finish(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("keep", PROMPT, greedy(max_tokens=12))
    engine.add_request("drop", PROMPT + " again", greedy(max_tokens=200))
    engine.step()
    engine.step()
    engine.abort_request("drop")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["keep"]
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_aborting_thousands_of_waiting_requests_takes_one_pass(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that leaves with thousands of prompts queued must not stall the engine: the
    abort is one pass over the queues, not one per request (that took minutes at 60,000)."""
    engine = llm.engine
    request_ids = [f"flood-{i}" for i in range(5000)]
    for request_id in request_ids:
        engine.add_request(request_id, [5, 6], greedy(max_tokens=1))
    waiting = engine.scheduler.waiting
    passes: list[int] = []
    real_remove_ids = waiting.remove_ids
    monkeypatch.setattr(
        waiting, "remove_ids", lambda ids: (passes.append(len(ids)), real_remove_ids(ids))
    )
    engine.abort_request(request_ids)
    assert passes == [len(request_ids)]  # one rebuild of the queue, however many leave
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_invalid_sampling_params_are_rejected_when_made(params: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**params)
    assert error.value.param == field


def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("good", PROMPT, greedy(max_tokens=4))
    bad_inputs = [
        ("too-long", [5] * (engine.max_model_len + 1), greedy(), "max_model_len"),
        ("empty", [], greedy(), "empty"),
        ("oov", [engine.vocab_size + 3], greedy(), "vocabulary"),
        ("bias", PROMPT, greedy(logit_bias={engine.vocab_size: 1.0}), "vocabulary"),
    ]
    for request_id, prompt, params, message in bad_inputs:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(request_id, prompt, params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["good"]


def test_chat_applies_the_tokenizers_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Reverse: a b c"}]
    out = llm.chat(messages, greedy(max_tokens=4), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert out.prompt == expected
    assert "<|im_start|>assistant" in out.prompt


def test_engine_statistics_are_readable(llm: LLM) -> None:
    before = llm.get_stats()
    llm.generate([PROMPT, "Hello"], greedy(max_tokens=3), use_tqdm=False)
    after = llm.get_stats()
    assert after.num_generation_tokens - before.num_generation_tokens == 6
    assert after.num_prompt_tokens > before.num_prompt_tokens
    assert after.scheduler.num_running == after.scheduler.num_waiting == 0
    assert after.scheduler.num_kv_blocks_used == 0
    assert after.scheduler.num_kv_blocks > 0
    forward = after.forward_seconds - before.forward_seconds
    assert 0 < forward <= after.step_seconds - before.step_seconds


def test_running_request_ids_name_requests_not_their_samples(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("pair", PROMPT, greedy(n=2, max_tokens=4))
    engine.add_request("single", "Hello", greedy(max_tokens=4))
    assert engine.running_request_ids() == set()  # nothing scheduled yet
    engine.step()
    assert engine.running_request_ids() == {"pair", "single"}
    # The scheduler knows each sample by its own id; callers see only the request's.
    assert {r.sample_id for r in engine.scheduler.running} == {"0_pair", "1_pair", "single"}
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert engine.running_request_ids() == set()
    assert sorted(finished) == ["pair", "single"]


def test_the_engine_keeps_its_parts_instead_of_copying_them(llm: LLM) -> None:
    engine = llm.engine
    assert {f.name for f in fields(EngineParts)} & set(vars(engine)) == set()
    assert engine.scheduler is engine.parts.scheduler
    assert engine.intake.kv_connector is None and engine.parts.kv_connectors is None


def test_dtype_auto_keeps_a_bfloat16_decoder_under_the_native_kernels(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 checkpoint's decoder stays bfloat16 while the native products run (they
    read its bytes on every ISA level); on the portable path it falls back to float32 where
    the CPU has no fast half."""
    from tokenmill.config.cpu_dtype import cpu_has_fast_half_matmul

    checkpoint = str(tiny_checkpoint("llama", dtype=torch.bfloat16))
    native = LLM(model=checkpoint, max_model_len=64)
    assert native.engine.parts.dtype == torch.bfloat16
    monkeypatch.setenv("TOKENMILL_NATIVE_KERNELS", "0")
    portable = LLM(model=checkpoint, max_model_len=64)
    expected = torch.bfloat16 if cpu_has_fast_half_matmul() else torch.float32
    assert portable.engine.parts.dtype == expected
    for llm in (native, portable):
        out = llm.generate(PROMPT, greedy(max_tokens=3), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 3


def test_dtype_auto_runs_a_float32_checkpoint_in_bfloat16_where_the_cpu_has_it(
    tiny_checkpoint,
) -> None:
    """As vLLM's CPU backend: bf16 where the CPU multiplies it natively (AVX512_BF16, AMX:
    read from /proc/cpuinfo here, not from the function under test); an explicit float32 is
    kept."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or torch.cuda.is_available():
        pytest.skip("reads the CPU's flags from Linux's /proc/cpuinfo")
    flags = set(cpuinfo.read_text().split())
    fast = bool(flags & {"avx512_bf16", "amx_bf16"})
    checkpoint = str(tiny_checkpoint("llama"))  # saved in float32
    auto = LLM(model=checkpoint, max_model_len=64)
    assert auto.engine.parts.dtype == (torch.bfloat16 if fast else torch.float32)
    forced = LLM(model=checkpoint, max_model_len=64, dtype="float32")
    assert forced.engine.parts.dtype == torch.float32


def test_chat_prompt_has_exactly_one_bos(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids.count(tokenizer.bos_token_id) == 1


def test_the_stop_token_is_not_in_the_text(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    stop_token = full.token_ids[5]
    first_at = full.token_ids.index(stop_token)
    params = greedy(stop_token_ids=[stop_token], skip_special_tokens=False)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert out.text == tokenizer.decode(full.token_ids[:first_at], skip_special_tokens=False)


def test_step_records_account_for_every_token_the_engine_computed(llm: LLM) -> None:
    engine = llm.engine
    stats_before = engine.get_stats()
    _, cursor = engine.step_records.since(0)
    llm.generate([PROMPT, "Hello"], greedy(max_tokens=5), use_tqdm=False)
    records, _ = engine.step_records.since(cursor)
    stats = engine.get_stats()
    assert len(records) == stats.num_steps - stats_before.num_steps
    num_prefill = sum(r.num_prefill_tokens for r in records)
    assert num_prefill == (
        stats.num_computed_prompt_tokens - stats_before.num_computed_prompt_tokens
    )
    # Each request's first token comes from its prompt's last step; the other 4 from decodes.
    assert sum(r.num_decode_tokens for r in records) == 2 * 4
    assert max(r.num_reqs for r in records) == 2
    assert all(r.seconds > 0 and r.num_preempted == 0 for r in records)
    assert [r.time for r in records] == sorted(r.time for r in records)


_CHILD_ENVIRONMENT_PROBE = """
import os, subprocess, sys
import tokenmill
assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # set before torch loads
from tokenmill import LLM
LLM(model=sys.argv[1], max_model_len=64)
child = "import os; print(os.environ.get('OMP_WAIT_POLICY'))"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout)
"""


def test_child_processes_do_not_inherit_tokenmills_openmp_wait_policy(tiny_checkpoint) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    probe = subprocess.run(
        [sys.executable, "-c", _CHILD_ENVIRONMENT_PROBE, str(tiny_checkpoint("llama"))],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert probe.stdout.split()[-1] == "None"
