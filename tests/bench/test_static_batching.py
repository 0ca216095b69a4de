"""The static-batching baseline, observed on a real engine: a request that arrives while a
batch runs gets no token until every member of that batch has finished, even when a member
finished early and left its slot empty. Continuous batching (fcfs) fills that slot at once."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams


def token_steps(policy: str, checkpoint: str) -> dict[str, list[int]]:
    """Run A (4 tokens) and B (12 tokens) in a batch of two; C arrives after the first step.
    Returns, per request, the engine steps at which it received a token."""
    llm = LLM(model=checkpoint, dtype="float32", max_model_len=128, max_num_seqs=2,
              scheduling_policy=policy)  # fmt: skip
    engine = llm.engine
    lengths = {"A": 4, "B": 12, "C": 3}

    def add(request_id: str) -> None:
        params = SamplingParams(max_tokens=lengths[request_id], temperature=0.0, ignore_eos=True)
        engine.add_request(request_id, f"request {request_id} says hello", params)

    add("A")
    add("B")
    steps: dict[str, list[int]] = {r: [] for r in lengths}
    seen: dict[str, int] = {r: 0 for r in lengths}
    for step in range(100):  # bounded: 12 + 3 steps suffice
        if step == 1:
            add("C")
        for output in engine.step():
            count = len(output.outputs[0].token_ids)
            if count > seen[output.request_id]:
                seen[output.request_id] = count
                steps[output.request_id].append(step)
        if not engine.has_unfinished_requests():
            break
    assert seen == lengths, "every request should have generated all its tokens"
    return steps


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


def test_static_batch_admits_nobody_until_every_member_finished(checkpoint: str) -> None:
    steps = token_steps("static", checkpoint)
    a_done, b_done = steps["A"][-1], steps["B"][-1]
    assert steps["A"][0] == steps["B"][0] == 0  # one batch of two
    assert a_done < b_done  # A's slot is free from here on ...
    assert steps["C"][0] > b_done  # ... yet C waits for the whole batch to end


def test_continuous_batching_fills_a_freed_slot_at_once(checkpoint: str) -> None:
    steps = token_steps("fcfs", checkpoint)
    a_done, b_done = steps["A"][-1], steps["B"][-1]
    assert a_done < steps["C"][0] < b_done  # C joins while B still runs
