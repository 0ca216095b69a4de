"""The engine with the Triton attention backend generates what it generates with the portable
one (fp32 greedy, token for token), over chunked prefill, decodes of different lengths in one
step, and a sliding window. Without CUDA the kernel runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention.triton_backend import TritonPagedAttention
from tokenmill.worker.capture_backends import eager_capture

pytestmark = pytest.mark.cuda  # natively on a GPU under `pytest -m cuda`

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7], [2, 71, 82, 81, 82]]


def greedy_token_ids(checkpoint: str, backend: str, captured: bool = False) -> list[list[int]]:
    """With `captured`, decode-only steps run through the captured step's static buffers
    (worker/captured_step.py), captured eagerly here (a CUDA graph on a GPU)."""
    llm = LLM(
        model=checkpoint,
        dtype="float32",
        max_model_len=64,
        max_num_batched_tokens=8,  # the first prompt is cut into chunks over its cached start
        num_kv_blocks=64,  # not sized from free GPU memory: the other engine may still hold it
        attention_backend=backend,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    attn = llm.engine.runner.model.layers[0].self_attn.attn
    assert isinstance(attn, TritonPagedAttention) == (backend == "triton")
    if captured:
        llm.engine.runner.use_captured_decode(4, llm.engine.max_model_len, capture=eager_capture)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert not captured or llm.engine.runner.decode_step.num_runs > 0
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_triton_backend_generates_what_the_portable_one_does(tiny_checkpoint) -> None:
    checkpoint = str(tiny_checkpoint("mistral", sliding_window=8))
    assert greedy_token_ids(checkpoint, "triton") == greedy_token_ids(checkpoint, "torch")


def test_captured_decode_steps_feed_the_triton_backend(tiny_checkpoint) -> None:
    """The captured step's static buffers carry what the kernel reads (sequence lengths, query
    starts), not only the portable backend's mask."""
    checkpoint = str(tiny_checkpoint("mistral", sliding_window=8))
    expected = greedy_token_ids(checkpoint, "torch")
    assert greedy_token_ids(checkpoint, "triton", captured=True) == expected
