"""LoRA beyond one dense model: two tensor-parallel ranks (each holding its shard of every
adapter) and a mixture-of-experts base (adapters on attention; MLP/expert targets refused),
greedy tokens against transformers + peft with the adapter merged, float32."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.sampling_params import InvalidRequestError
from tokenmill_testing.engines import make_llm
from tokenmill_testing.lora_adapters import merged_reference, save_random_adapter
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 8
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in (6, 23)]


def expected_tokens(
    base: Path, loras: list[LoRARequest | None], prompts: list[list[int]]
) -> list[list[int]]:
    """The merged reference's greedy tokens, each prompt under each of `loras` in order."""
    tokens = []
    for lora in loras:
        model = merged_reference(base, None if lora is None else lora.lora_path)
        tokens += greedy_reference(model, prompts, MAX_TOKENS)[0]
    return tokens


def generate_mixed(
    llm: LLM, loras: list[LoRARequest | None], prompts: list[list[int]]
) -> list[list[int]]:
    """Every prompt under each of `loras`, all in one call."""
    batch = [(p, lora) for lora in loras for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [p for p, _ in batch], params, use_tqdm=False, lora_request=[r for _, r in batch]
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.slow(reason="starts tensor-parallel worker processes")
def test_two_ranks_serve_mixed_adapters_as_transformers_peft(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, prompts
) -> None:
    """One KV head over two ranks (replicated: each rank takes k/v's B rows whole) and an
    uneven vocabulary; every target, rslora on a few; chunked prompts and n-gram drafts."""
    base = tiny_checkpoint("mistral", num_key_value_heads=1)
    loras: list[LoRARequest | None] = [
        None,
        LoRARequest("all", 1, str(save_random_adapter(base, tmp_path / "all", seed=1))),
        LoRARequest(
            "rs",
            2,
            str(
                save_random_adapter(
                    base,
                    tmp_path / "rs",
                    rank=4,
                    use_rslora=True,
                    targets=("v_proj", "o_proj", "down_proj"),
                    seed=2,
                )
            ),
        ),
    ]
    expected = expected_tokens(base, loras, prompts)
    llm = make_llm(
        base,
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=2,
        max_num_batched_tokens=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "adaptive": False},
    )
    try:
        assert generate_mixed(llm, loras, prompts) == expected
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def moe_base(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("mixtral", num_local_experts=4, num_experts_per_tok=2)


def test_attention_adapters_on_a_mixture_of_experts_base(
    moe_base: Path, tmp_path: Path, prompts
) -> None:
    adapter = save_random_adapter(moe_base, tmp_path / "attention", targets=ATTENTION, seed=3)
    loras = [None, LoRARequest("attention", 1, str(adapter))]
    expected = expected_tokens(moe_base, loras, prompts)
    assert expected[: len(prompts)] != expected[len(prompts) :]
    llm = make_llm(moe_base, enable_lora=True)
    assert generate_mixed(llm, loras, prompts) == expected

    # The same adapter with an MLP target added: refused, naming why.
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.mlp.experts.0.w1"
    tensors[f"{prefix}.lora_A.weight"] = tensors[next(k for k in tensors if "lora_A" in k)].clone()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(InvalidRequestError, match="mixture of experts"):
        generate_mixed(llm, [LoRARequest("mlp", 2, str(adapter))], prompts)
