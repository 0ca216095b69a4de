"""Mixture-of-experts models (models/families/mixtral.py, qwen_moe.py) against transformers:
greedy tokens equal in float32 for each family, with chunked prefill, preemption, prefix hits
and speculative drafts in the batch; int8 experts close; routed-only MoE layers run inside the
fused decoder stack (a shared expert keeps the modules); a clear error for what is
unsupported."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.models.config_checks import ModelLoadError
from tokenmill.models.loader import load_hf_config
from tokenmill_testing.quantized_checkpoints import TOLERANCE
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 10

FAMILIES = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # A shared expert with its sigmoid gate, top-k weights not renormalised.
    "qwen2_moe": {
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": False,
    },
    # q/k norms, renormalised top-k, a dense layer (mlp_only_layers) and one that the sparse
    # step leaves dense (layer 1 of step 2): layers 0 dense, 1 MoE, 2 dense.
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_hidden_layers": 3,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [2],
    },
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint(request.param, **FAMILIES[request.param])


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    phrase = [rng.randrange(3, vocab) for _ in range(7)]
    return [
        phrase * 4,
        [rng.randrange(3, vocab) for _ in range(37)],
        [*phrase * 2, 5, 6],  # shares its start with the first: a prefix hit
        phrase[:3],
        [rng.randrange(3, vocab) for _ in range(20)],
    ]


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = prompts_for(model.config.vocab_size)
    expected, logprobs = greedy_reference(model, prompts, MAX_TOKENS)
    return prompts, expected, logprobs


def greedy(**kwargs) -> SamplingParams:
    """Greedy, EOS never picked: as the reference's `min_new_tokens` (which masks it)."""
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True, **kwargs
    )


def hard_engine(checkpoint: Path, num_kv_blocks: int, **kwargs) -> LLM:
    """Chunks of 7 tokens, blocks of 4, prefix caching and drafts of the model itself."""
    return LLM(
        model=str(checkpoint),
        dtype="float32",
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_model_len=64,
        max_num_batched_tokens=7,
        enable_prefix_caching=True,
        speculative_config={
            "method": "draft_model",
            "model": str(checkpoint),
            "num_speculative_tokens": 3,
            "adaptive": False,
        },
        **kwargs,
    )


def in_two_waves(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """The first prompt alone first, so that the third hits its cached prefix."""
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    rest = llm.generate(prompts[1:], greedy(), use_tqdm=False)
    return [first, *(o.outputs[0].token_ids for o in rest)]


def moe_blocks(llm: LLM) -> list[FusedMoE]:
    model = llm.engine.runner.model
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, FusedMoE)]


def test_greedy_equals_transformers_chunked_preempted_with_prefix_hits(
    checkpoint: Path, reference
) -> None:
    prompts, expected, _ = reference
    roomy = hard_engine(checkpoint, num_kv_blocks=80)
    assert moe_blocks(roomy)
    # Routed experts alone run inside the fused decoder stack; a shared expert keeps the modules.
    shared = any(block.shared_expert is not None for block in moe_blocks(roomy))
    assert (roomy.engine.runner.model.decoder_stack is None) == shared
    assert in_two_waves(roomy, prompts) == expected
    stats = roomy.get_stats().scheduler
    assert stats.prefix_cache.hits > 0
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0
    tight = hard_engine(checkpoint, num_kv_blocks=16)
    assert in_two_waves(tight, prompts) == expected
    assert tight.get_stats().scheduler.num_preemptions > 0


@pytest.mark.parametrize("linear_backend", ["auto", "torch"])
def test_logprobs_close_to_transformers(checkpoint: Path, reference, linear_backend: str) -> None:
    """The CPU default runs the experts in the native MoE kernel; `linear_backend="torch"`
    the torch reference: both as transformers."""
    prompts, expected, ref_logprobs = reference
    llm = LLM(
        model=str(checkpoint), dtype="float32", max_model_len=64, linear_backend=linear_backend
    )
    outputs = llm.generate(prompts, greedy(logprobs=2), use_tqdm=False)
    native_expected = linear_backend == "auto" and native_kernels() is not None
    in_stack = llm.engine.runner.model.decoder_stack is not None  # the stack ran the experts
    shared = any(block.shared_expert is not None for block in moe_blocks(llm))
    assert in_stack == (native_expected and not shared)
    if not in_stack:
        assert all(block.uses_native_kernel == native_expected for block in moe_blocks(llm))
    for output, ref, tokens in zip(outputs, ref_logprobs, expected):
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        for position, (token_id, logprobs) in enumerate(zip(tokens, completion.logprobs)):
            assert abs(logprobs[token_id].logprob - ref[position, token_id].item()) < 1e-4


def test_bfloat16_stays_close_to_transformers_float32(checkpoint: Path, reference) -> None:
    """bf16 weights and activations (float32 router logits and expert sums): the reference's
    greedy token keeps a log-probability within 0.1 of float32's while the continuations
    agree (near ties may part them)."""
    prompts, expected, ref_logprobs = reference
    llm = LLM(model=str(checkpoint), dtype="bfloat16", max_model_len=64)
    outputs = llm.generate(prompts, greedy(logprobs=5), use_tqdm=False)
    compared = 0
    for output, ref, tokens in zip(outputs, ref_logprobs, expected):
        completion = output.outputs[0]
        for position, (got, want) in enumerate(zip(completion.token_ids, tokens)):
            logprobs = completion.logprobs[position]
            if want in logprobs:
                assert abs(logprobs[want].logprob - ref[position, want].item()) < 0.1
                compared += 1
            if got != want:
                break
    assert compared >= len(prompts)


def test_the_families_dense_and_sparse_layers(tiny_checkpoint) -> None:
    """Qwen3-MoE's layer 0 is dense by the sparse step, layer 2 by mlp_only_layers; Qwen2-MoE
    has a shared expert with a gate; the routers stay float under --quantization int8."""
    qwen3 = LLM(model=str(tiny_checkpoint("qwen3_moe", **FAMILIES["qwen3_moe"])), dtype="float32")
    layers = qwen3.engine.runner.model.layers
    assert [isinstance(layer.mlp, FusedMoE) for layer in layers] == [False, True, False]
    qwen2 = LLM(
        model=str(tiny_checkpoint("qwen2_moe", **FAMILIES["qwen2_moe"])),
        dtype="float32",
        quantization="int8",
    )
    block = moe_blocks(qwen2)[0]
    assert block.shared_expert is not None and block.shared_expert_gate is not None
    assert block.gate.weight.dtype == torch.float32
    assert block.experts[0].gate_up_proj.quant_method.weight_format == "int8"


def test_int8_experts_stay_close_to_float(checkpoint: Path, reference) -> None:
    """`--quantization int8` quantizes every expert (the routers stay float): the reference's
    greedy token keeps a log-probability within the int8 kernels' tolerance of float32's
    while the continuations agree (near ties may part them)."""
    prompts, expected, ref_logprobs = reference
    llm = LLM(model=str(checkpoint), dtype="float32", max_model_len=64, quantization="int8")
    outputs = llm.generate(prompts, greedy(logprobs=5), use_tqdm=False)
    compared = 0
    for output, ref, tokens in zip(outputs, ref_logprobs, expected):
        completion = output.outputs[0]
        for position, (got, want) in enumerate(zip(completion.token_ids, tokens)):
            logprobs = completion.logprobs[position]
            if want in logprobs:
                assert abs(logprobs[want].logprob - ref[position, want].item()) < TOLERANCE["int8"]
                compared += 1
            if got != want:
                break
    assert compared >= len(prompts)


def test_an_unsupported_architecture_is_one_line_naming_the_supported(
    tiny_checkpoint, tmp_path: Path
) -> None:
    source = tiny_checkpoint("mixtral", **FAMILIES["mixtral"])
    target = tmp_path / "model"
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["DbrxForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        load_hf_config(target)
    message = str(error.value)
    assert "\n" not in message and "DbrxForCausalLM" in message
    supported_moe = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    for supported in (*supported_moe, "GptOssForCausalLM"):
        assert supported in message


@pytest.mark.slow(reason="starts a second tensor-parallel rank")
def test_tensor_parallel_shards_every_expert_and_matches_one_rank(tiny_checkpoint) -> None:
    """Two ranks, each holding half of every expert's (and the shared expert's) width, give
    one rank's greedy tokens through chunked prefill and preemption."""
    checkpoint = str(tiny_checkpoint("qwen2_moe", **FAMILIES["qwen2_moe"]))
    engine = {
        "dtype": "float32",
        "max_model_len": 64,
        "block_size": 4,
        "max_num_batched_tokens": 12,
        "num_kv_blocks": 16,
    }
    prompts = prompts_for(1000)[:3]
    single = LLM(checkpoint, **engine)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, greedy(), use_tqdm=False)]
    sharded = LLM(checkpoint, tensor_parallel_size=2, **engine)
    try:
        outputs = sharded.generate(prompts, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert sharded.get_stats().scheduler.num_preemptions > 0
    finally:
        sharded.engine.shutdown()
