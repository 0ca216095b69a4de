"""Families beyond the Llama line (Phi-3, Gemma 2 and 3; models/families/) against transformers:
greedy tokens equal in float32 with chunked prefill, prefix hits and preemption in the batches,
through the native kernels (the fused stack) and through the layer modules."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import native
from tokenmill.models.config_checks import ModelLoadError
from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP
from tokenmill.models.loader import MODEL_REGISTRY, load_hf_config
from tokenmill.quantization.int4 import quantize_int4
from tokenmill.quantization.int8 import quantize_int8
from tokenmill_testing.quantized_checkpoints import (
    compare_with_reference,
    random_prompts,
    save_dequantized_checkpoint,
)
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 8
MAX_MODEL_LEN = 40

PHI3 = {
    "architecture": "phi3",
    "head_dim": 16,
    "partial_rotary_factor": 0.5,  # 8 of each head's 16 dimensions rotate
}
# LongRoPE's factors per rotated pair (rotary_dim / 2 of them).
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 2.0, 3.0],
    "long_factor": [2.0, 4.0, 7.0, 11.0],
}
CHECKPOINTS: dict[str, dict[str, Any]] = {
    # The served context (64) within the original one: the short factors, with the attention
    # factor of `factor` 4.
    "phi3-longrope-short": {
        **PHI3,
        "original_max_position_embeddings": 2048,
        "rope_scaling": {**LONGROPE, "factor": 4.0, "original_max_position_embeddings": 2048},
    },
    # The served context past the original 4 positions: the long factors for every position,
    # as transformers uses for sequences longer than the original context (every prompt is).
    "phi3-longrope-long": {
        **PHI3,
        "original_max_position_embeddings": 4,
        "rope_scaling": {**LONGROPE, "original_max_position_embeddings": 4},
    },
    "gemma3": {
        "head_dim": 16,
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 6,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 5.0,
    },
    # Attention and final logits soft-capped low enough that the caps bend them.
    "gemma2": {
        "head_dim": 16,
        "num_hidden_layers": 3,
        "sliding_window": 6,
        "query_pre_attn_scalar": 8,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
    },
    "gemma3-tied-linear-rope": {
        "architecture": "gemma3",
        "head_dim": 16,
        "tie_word_embeddings": True,
        "layer_types": ["full_attention", "sliding_attention"],
        "sliding_window": 5,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "query_pre_attn_scalar": 16,
    },
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tiny_checkpoint) -> Path:
    kwargs = dict(CHECKPOINTS[request.param])
    architecture = kwargs.pop("architecture", request.param)
    return tiny_checkpoint(architecture, **kwargs)


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(2)
    phrase = [rng.randrange(3, vocab) for _ in range(7)]
    return [
        phrase * 3,
        [rng.randrange(3, vocab) for _ in range(30)],
        [*phrase * 2, 5, 6],  # shares its start with the first: a prefix hit
        phrase[:5],
        [rng.randrange(3, vocab) for _ in range(13)],
    ]


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> tuple[list[list[int]], list[list[int]]]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = prompts_for(model.config.vocab_size)
    expected, _ = greedy_reference(model, prompts, MAX_TOKENS)
    return prompts, expected


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


# The fused native stack (the CPU default) and the layer modules with torch's kernels.
PATHS = {"native": {}, "modules": {"attention_backend": "torch", "linear_backend": "torch"}}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_greedy_equals_transformers_chunked_preempted_with_prefix_hits(
    checkpoint: Path, reference, path: str
) -> None:
    prompts, expected = reference
    # Chunks of 7 tokens in blocks of 4; 10 blocks hold the longest request but not the batch.
    llm = LLM(
        model=str(checkpoint),
        dtype="float32",
        block_size=4,
        # Gemma 3's sliding groups keep their window's blocks beside the full group's.
        num_kv_blocks=10 if "gemma" not in checkpoint.name else 20,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=7,
        enable_prefix_caching=True,
        **PATHS[path],
    )
    stack = llm.engine.runner.model.decoder_stack
    assert (stack is not None) == (path == "native")
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    rest = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], greedy(), use_tqdm=False)]
    assert [first, *rest] == expected
    stats = llm.get_stats().scheduler
    assert stats.prefix_cache.hits > 0
    assert stats.num_preemptions > 0


NATIVE = native.native_kernels()
LEVELS = list(range(NATIVE.detect_isa() + 1)) if NATIVE is not None else []


@pytest.mark.skipif(NATIVE is None, reason="native kernels not buildable here")
@pytest.mark.parametrize("level", LEVELS, ids=lambda level: native.ISA_LEVELS[level])
def test_native_stack_greedy_equals_transformers_at_every_isa_level(
    checkpoint: Path, reference, level: int
) -> None:
    assert NATIVE is not None
    prompts, expected = reference
    best = NATIVE.get_isa()
    try:
        assert NATIVE.set_isa(level) == level
        llm = LLM(model=str(checkpoint), dtype="float32", max_model_len=MAX_MODEL_LEN)
        assert llm.engine.runner.model.decoder_stack is not None
        outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    finally:
        NATIVE.set_isa(best)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_unsupported_architecture_names_the_registry(tiny_checkpoint, tmp_path: Path) -> None:
    source = tiny_checkpoint("llama")
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        load_hf_config(tmp_path)
    message = str(error.value)
    assert "\n" not in message and "GPTNeoXForCausalLM" in message
    for architecture in (
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
        "LlamaForCausalLM",
    ):
        assert architecture in MODEL_REGISTRY and architecture in message


# Gemma 3 as llama.cpp's GGUF files describe it: every sixth layer global, query scale
# 1/sqrt(head_dim), local RoPE base 10000 (quantization/gguf_gemma3.py).
GEMMA3_AS_LLAMA_CPP = {
    "head_dim": 16,
    "num_hidden_layers": 6,
    "sliding_window": 6,
    "rope_theta": 1e6,
    "query_pre_attn_scalar": 16,
    "final_logit_softcapping": 5.0,
}


# GGUF files as llama.cpp's converter lays them out (its names; Gemma's norms stored as 1 + w;
# Phi-3's q/k/v and gate/up fused, LongRoPE's factors as tensors).
GGUF_CHECKPOINTS = {
    "gemma3": GEMMA3_AS_LLAMA_CPP,
    # Gemma 2 as llama.cpp reads it: query scale 1/sqrt(head_dim), even layers local, the
    # LM head the embeddings.
    "gemma2": {**CHECKPOINTS["gemma2"], "query_pre_attn_scalar": 16, "tie_word_embeddings": True},
    "phi3": {
        key: value
        for key, value in CHECKPOINTS["phi3-longrope-long"].items()
        if key != "architecture"
    },
}


@pytest.mark.parametrize("family", sorted(GGUF_CHECKPOINTS))
def test_gguf_greedy_equals_transformers(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    """The F32 file against transformers on the checkpoint it was written from."""
    from gguf import GGMLQuantizationType

    from tokenmill_testing.gguf_checkpoint import save_gguf

    checkpoint = tiny_checkpoint(family, **GGUF_CHECKPOINTS[family])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = prompts_for(model.config.vocab_size)
    expected, _ = greedy_reference(model, prompts, MAX_TOKENS)
    path = save_gguf(
        checkpoint, tmp_path / f"{family}.gguf", GGMLQuantizationType.F32, architecture=family
    )
    llm = LLM(model=str(path), dtype="float32", max_model_len=MAX_MODEL_LEN)
    assert llm.engine.runner.model.architecture == model.config.architectures[0]
    assert llm.engine.runner.model.decoder_stack is not None
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


# What each online scheme's kernels multiply by (as tests/model/test_quantization.py).
ROUND_TRIPS = {
    "int8": lambda name, w: quantize_int8(w).dequantize(),
    "int4": lambda name, w: quantize_int4(w, 32).dequantize(),
}


@pytest.mark.parametrize("scheme", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("name", ["gemma3", "phi3-longrope-short"])
def test_online_quantization_matches_the_dequantized_float_model(
    tiny_checkpoint, tmp_path: Path, name: str, scheme: str, activation_tolerance: float
) -> None:
    """The native stack on int8 / int4 weights against transformers on the same rounding."""
    kwargs = dict(CHECKPOINTS[name])
    checkpoint = tiny_checkpoint(kwargs.pop("architecture", name), **kwargs)
    head = lambda w: quantize_int8(w).dequantize()  # noqa: E731  (the LM head: int8 rows)
    reference_dir = save_dequantized_checkpoint(
        checkpoint, tmp_path / "ref", ROUND_TRIPS[scheme], head
    )
    llm = LLM(model=str(checkpoint), dtype="float32", quantization=scheme, max_model_len=128)
    assert llm.engine.runner.model.decoder_stack is not None
    prompts = random_prompts(llm.engine.vocab_size)
    assert compare_with_reference(llm, reference_dir, prompts, activation_tolerance) < (
        activation_tolerance
    )


def test_captured_decode_equals_transformers_with_window_groups(
    checkpoint: Path, reference
) -> None:
    """Decode steps through the captured step's static buffers (eager capture: the buffers,
    not the compiler, are what differ), with a hybrid cache's every KV group and the layers'
    own window masks, around chunks, preemption and prefix hits."""
    from tokenmill.worker.capture_backends import eager_capture

    prompts, expected = reference
    llm = LLM(
        model=str(checkpoint),
        dtype="float32",
        block_size=4,
        num_kv_blocks=10 if "gemma" not in checkpoint.name else 20,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=7,
        enable_prefix_caching=True,
    )
    runner = llm.engine.runner
    runner.use_captured_decode(8, llm.engine.max_model_len, capture=eager_capture)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert runner.decode_step.num_runs > 0
    stats = llm.get_stats().scheduler
    assert stats.prefix_cache.hits > 0 and stats.num_preemptions > 0


class _CountingMLP(LlamaMLP):
    """A family's own MLP (as an MoE family's experts would be): the dense one, counted."""

    calls = 0

    def __init__(self, shape, traits, tp, layer_index: int, hf_config) -> None:
        super().__init__(shape, traits, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CountingMLP.calls += 1
        return super().forward(x)


def test_a_family_with_its_own_mlp_runs_its_layers_as_modules(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry's hook for families beyond the dense MLP: registered by name, its MLP
    built per layer, the fused stack (which knows only the dense MLP) declining it."""
    from tokenmill.models import registry
    from tokenmill.models.families.llama import llama_traits
    from tokenmill.models.family import Family

    family = Family("counted", ("CountedForCausalLM",), llama_traits, mlp=_CountingMLP)
    monkeypatch.setitem(registry._FAMILIES, family.name, family)
    monkeypatch.setitem(MODEL_REGISTRY, "CountedForCausalLM", LlamaForCausalLM)
    source = tiny_checkpoint("llama")
    for path in source.iterdir():
        (tmp_path / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "architectures": ["CountedForCausalLM"]})
    )
    prompt = [[5, 9, 13, 200, 7]]
    counted = LLM(model=str(tmp_path), dtype="float32", max_model_len=MAX_MODEL_LEN)
    assert counted.engine.runner.model.decoder_stack is None
    tokens = counted.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert _CountingMLP.calls > 0
    dense = LLM(model=str(source), dtype="float32", max_model_len=MAX_MODEL_LEN)
    assert dense.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_the_registry_tells_mixtral_gguf_files_from_dense_llama_by_their_experts() -> None:
    """llama.cpp writes Mixtral as `llama` with `llama.expert_count`; qwen2moe / qwen3moe
    files are mixtures of experts only."""
    from tokenmill.models.registry import gguf_family

    assert gguf_family("llama").name == "llama"
    assert gguf_family("llama", experts=True).name == "mixtral"
    assert gguf_family("qwen3moe", experts=True).name == "qwen_moe"
    assert gguf_family("qwen3moe") is None
    assert gguf_family("gemma3").name == "gemma3"


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_gemma3_frees_blocks_behind_the_window_and_equals_transformers(
    tiny_checkpoint, preemption_mode: str, path: str
) -> None:
    """A window of 8 in blocks of 4, prompts of 40+ tokens: the sliding group's blocks behind
    the window go back to the pool (core/kv/window_groups.py) through chunks, prefix hits and
    preemption, and the tokens stay transformers'."""
    checkpoint = tiny_checkpoint("gemma3", **{**CHECKPOINTS["gemma3"], "sliding_window": 8})
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rng = random.Random(3)
    head = [rng.randrange(3, model.config.vocab_size) for _ in range(40)]
    prompts = [
        [*head, *(rng.randrange(3, model.config.vocab_size) for _ in range(n))] for n in (4, 9, 2)
    ]
    expected, _ = greedy_reference(model, prompts, MAX_TOKENS)
    llm = LLM(
        model=str(checkpoint),
        dtype="float32",
        block_size=4,
        num_kv_blocks=27,
        max_model_len=64,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        preemption_mode=preemption_mode,
        swap_space=0.001,
        **PATHS[path],
    )
    manager = llm.engine.kv_cache_manager
    assert manager.groups is not None
    spy = StackCalls(llm.engine.runner.model.decoder_stack)
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    rest = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], greedy(), use_tqdm=False)]
    assert [first, *rest] == expected
    stats = llm.get_stats().scheduler
    assert stats.prefix_cache.hits > 0 and stats.num_preemptions > 0
    assert manager.num_free_blocks == manager.num_blocks - 1  # all back but the null block
    assert (spy.calls > 0) == (path == "native")  # the fused stack ran the hybrid steps


class StackCalls:
    """Counts the fused stack's steps (None: no stack)."""

    def __init__(self, stack: Any) -> None:
        self.calls = 0
        if stack is None:
            return
        forward = stack.native.forward

        class Counting:
            def __getattr__(_, name: str) -> Any:
                return getattr(native_stack, name)

            def forward(_, *args: Any) -> Any:
                self.calls += 1
                return forward(*args)

        native_stack = stack.native
        stack.native = Counting()
