"""Multi-LoRA serving against transformers + peft (each adapter merged, float32): greedy
tokens of the base and several adapters sent together in one batch, adapters swapped through
fewer slots than adapters, the prefix cache kept apart per adapter, and clear errors for
adapters the engine cannot serve."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.sampling_params import InvalidRequestError
from tokenmill_testing.engines import make_llm
from tokenmill_testing.lora_adapters import merged_reference, save_random_adapter
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 8
PROMPT_LENS = (5, 19, 34)
# name -> the adapter's peft settings: every target at rank 8; rslora on three targets at
# rank 4; the MLP alone at rank 16.
ADAPTERS: dict[str, dict] = {
    "all": {"rank": 8, "alpha": 16.0, "seed": 1},
    "rslora": {
        "rank": 4,
        "alpha": 8.0,
        "use_rslora": True,
        "targets": ("q_proj", "v_proj", "down_proj"),
        "seed": 2,
    },
    "mlp": {"rank": 16, "alpha": 8.0, "targets": ("gate_proj", "up_proj", "down_proj"), "seed": 3},
}


@pytest.fixture(scope="module")
def base(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: LoRARequest(name, index, str(save_random_adapter(base, root / name, **kwargs)))
        for index, (name, kwargs) in enumerate(ADAPTERS.items(), start=1)
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(
    base: Path, adapters: dict[str, LoRARequest], prompts: list[list[int]]
) -> dict[str | None, list[list[int]]]:
    """Greedy tokens per adapter name (None: the base) from the merged reference."""
    result: dict[str | None, list[list[int]]] = {}
    for name, request in [(None, None), *adapters.items()]:
        model = merged_reference(base, None if request is None else request.lora_path)
        result[name] = greedy_reference(model, prompts, MAX_TOKENS)[0]
    return result


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate_mixed(
    llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]
) -> dict[str | None, list[list[int]]]:
    """Every prompt under every adapter (and the base), all sent in one call."""
    batch = [(p, lora) for lora in loras for p in prompts]
    outputs = llm.generate(
        [p for p, _ in batch], greedy(), use_tqdm=False, lora_request=[r for _, r in batch]
    )
    got: dict[str | None, list[list[int]]] = {}
    for (_, lora), output in zip(batch, outputs):
        got.setdefault(None if lora is None else lora.lora_name, []).append(
            list(output.outputs[0].token_ids)
        )
    return got


def test_adapters_change_the_reference(expected) -> None:
    """The test adapters matter: each one's tokens differ from the base's."""
    for name in ADAPTERS:
        assert expected[name] != expected[None]


def test_base_and_adapters_in_one_batch_equal_transformers_peft(
    base: Path, adapters: dict[str, LoRARequest], prompts, expected
) -> None:
    llm = make_llm(base, enable_lora=True, max_loras=3, max_lora_rank=16)
    got = generate_mixed(llm, prompts, [None, *adapters.values()])
    assert got == expected


def test_more_adapters_than_slots_swap_through_the_lru(
    base: Path, adapters: dict[str, LoRARequest], prompts, expected
) -> None:
    """Two slots for three adapters: the scheduler holds back a third adapter's requests
    until a slot frees; the slot is then rewritten with the newcomer."""
    llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=16)
    assert generate_mixed(llm, prompts, [*adapters.values(), None]) == expected
    manager = llm.engine.runner.lora
    assert manager is not None and len(manager.resident_ids) == 2


def test_prefix_cache_is_keyed_by_adapter(
    base: Path, adapters: dict[str, LoRARequest], prompts, expected
) -> None:
    """The long prompt under one adapter, then the base and another adapter: neither reuses
    the first one's KV (their tokens stay right); the same adapter again does."""
    llm = make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=16)
    long_prompt = prompts[-1]
    cached = []
    for name in ("all", None, "rslora", "all"):
        request = None if name is None else adapters[name]
        output = llm.generate([long_prompt], greedy(), use_tqdm=False, lora_request=request)[0]
        assert list(output.outputs[0].token_ids) == expected[name][-1]
        cached.append(output.num_cached_tokens)
    # Only the repeat of "all" finds cached blocks: 2 full blocks of 16 of its 34 tokens.
    assert cached == [0, 0, 0, 32]


@pytest.fixture(scope="module")
def lora_llm(base: Path) -> LLM:
    return make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"targets": ("q_proj", "lm_head")}, "LM head"),
        ({"targets": ("q_proj", "embed_tokens")}, "embeddings"),
        ({"rank": 32}, "above --max-lora-rank 16"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "DoRA"),
    ],
    ids=["lm_head", "embed_tokens", "rank", "modules_to_save", "dora"],
)
def test_unsupported_adapters_are_refused_clearly(
    base: Path, lora_llm: LLM, prompts, expected, tmp_path: Path, kwargs: dict, message: str
) -> None:
    """Refused at the request, naming why; the engine goes on serving."""
    path = save_random_adapter(base, tmp_path / "bad", **kwargs)
    with pytest.raises(InvalidRequestError, match=message):
        lora_llm.generate(
            prompts, greedy(), use_tqdm=False, lora_request=LoRARequest("b", 9, str(path))
        )
    outputs = lora_llm.generate(prompts, greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected[None]


def test_an_adapter_of_another_base_is_refused(
    tiny_checkpoint: Callable[..., Path], lora_llm: LLM, prompts, tmp_path: Path
) -> None:
    other = tiny_checkpoint("llama", hidden_size=32, intermediate_size=64)
    path = save_random_adapter(other, tmp_path / "other")
    with pytest.raises(InvalidRequestError, match="another base model"):
        lora_llm.generate(
            prompts, greedy(), use_tqdm=False, lora_request=LoRARequest("o", 8, str(path))
        )


def test_a_missing_adapter_directory_is_refused(lora_llm: LLM, prompts, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match=r"no adapter_config\.json"):
        lora_llm.generate(
            prompts, greedy(), use_tqdm=False, lora_request=LoRARequest("m", 7, str(tmp_path))
        )


def test_lora_requests_need_enable_lora(base: Path, adapters, prompts) -> None:
    llm = make_llm(base)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.generate(prompts, greedy(), use_tqdm=False, lora_request=adapters["all"])


def test_adapter_and_base_steps_keep_the_fused_stack(
    base: Path, adapters: dict[str, LoRARequest], prompts, expected
) -> None:
    """Steps with adapter rows and base-only steps all run the fused native stack, which
    adds the adapters itself (tests/model/test_lora_stack.py: at every ISA level)."""
    llm = make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=16)
    model = llm.engine.runner.model
    stack = model.decoder_stack
    assert stack is not None and stack.lora_mapping is llm.engine.runner.lora.mapping
    outputs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=adapters["mlp"])
    assert model.decoder_stack is stack
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected["mlp"]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected[None]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.slow(reason="a dequantized checkpoint, its reference and an engine per scheme")
def test_adapter_on_a_quantized_base_matches_its_merged_dequantized_reference(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, scheme: str
) -> None:
    """QLoRA-style: the base's linears quantized, the adapter float. The reference is
    transformers on the dequantized base with the adapter merged (what the engine computes:
    the quantized product plus the float adapter's); scored teacher-forced, float
    activations."""
    from tokenmill.quantization.int4 import quantize_int4
    from tokenmill.quantization.int8 import quantize_int8
    from tokenmill_testing.quantized_checkpoints import (
        TOLERANCE,
        activation_path,
        compare_with_reference,
        random_prompts,
        save_dequantized_checkpoint,
    )

    round_trips = {
        "int8": lambda name, w: quantize_int8(w).dequantize(),
        "int4": lambda name, w: quantize_int4(w, 32).dequantize(),
    }
    checkpoint = tiny_checkpoint("llama", hidden_size=128, intermediate_size=256)
    adapter = save_random_adapter(checkpoint, tmp_path / "adapter", rank=8, seed=5)
    dequantized = save_dequantized_checkpoint(
        checkpoint,
        tmp_path / "dequantized",
        round_trips[scheme],
        lambda w: quantize_int8(w).dequantize(),
    )
    merged_reference(dequantized, adapter).save_pretrained(tmp_path / "reference")
    llm = make_llm(checkpoint, quantization=scheme, enable_lora=True, max_model_len=128)
    request = LoRARequest("q", 1, str(adapter))

    class WithAdapter:
        def generate(self, *args, **kwargs):
            return llm.generate(*args, lora_request=request, **kwargs)

    with activation_path("float"):
        max_diff = compare_with_reference(
            WithAdapter(),
            tmp_path / "reference",
            random_prompts(llm.engine.vocab_size),
            TOLERANCE["float"],
        )
    assert max_diff < TOLERANCE["float"]


def test_the_store_keeps_max_cpu_loras_least_recently_used_first(
    lora_llm: LLM, adapters: dict[str, LoRARequest]
) -> None:
    """Two kept in host memory (max_cpu_loras defaults to max_loras = 2): a third load drops
    the least recently used; one still held is served without reading the disk again."""
    from tokenmill.lora.adapter_store import LoRAAdapterStore

    engine_store = lora_llm.engine.parts.lora_store
    assert engine_store is not None and engine_store.max_cpu_loras == 2
    store = LoRAAdapterStore(engine_store.base, 16, max_cpu_loras=2)
    first = store.get(adapters["all"])
    store.get(adapters["rslora"])
    assert store.get(adapters["all"]) is first and len(store.load_seconds) == 2
    store.get(adapters["mlp"])  # drops "rslora", the least recently used
    assert store.loaded_ids == [adapters["all"].lora_int_id, adapters["mlp"].lora_int_id]
    store.get(adapters["rslora"])
    assert len(store.load_seconds) == 4


@pytest.fixture(scope="module")
def repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so the n-gram proposer finds drafts (a seed whose
    greedy continuations never reach EOS, which the reference cannot pick)."""
    rng = random.Random(8)
    prompts = []
    for length in (6, 9, 5):
        pattern = [rng.randrange(3, 1000) for _ in range(length)]
        prompts.append(pattern * 3)
    return prompts


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.slow(reason="three references and an engine per preemption mode")
def test_chunked_prefill_preemption_and_ngram_drafts_keep_each_adapter(
    base: Path,
    adapters: dict[str, LoRARequest],
    repetitive_prompts: list[list[int]],
    preemption_mode: str,
) -> None:
    """Prompts cut into chunks of 7 tokens, blocks of 4 and few of them (preemption), n-gram
    drafts verified in the adapter's rows: the tokens stay transformers + peft's."""
    loras = [None, adapters["all"], adapters["rslora"]]
    expected = {}
    for lora in loras:
        model = merged_reference(base, None if lora is None else lora.lora_path)
        expected[None if lora is None else lora.lora_name] = greedy_reference(
            model, repetitive_prompts, MAX_TOKENS
        )[0]
    llm = make_llm(
        base,
        enable_lora=True,
        max_loras=3,
        block_size=4,
        num_kv_blocks=12,
        max_model_len=48,
        max_num_batched_tokens=7,
        preemption_mode=preemption_mode,
        swap_space=0.01,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    )
    assert generate_mixed(llm, repetitive_prompts, loras) == expected
    stats = llm.get_stats().scheduler
    assert stats.num_preemptions > 0
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0


def test_structured_outputs_with_an_adapter(lora_llm: LLM, adapters, prompts) -> None:
    """The grammar's mask applies to the adapter's logits: every reply is one of the choices,
    and the adapters pick differently from the base somewhere."""
    from tokenmill import StructuredOutputsParams

    choices = ["alpha", "beta", "gamma", "delta"]
    params = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    picks = {}
    for name in (None, "all", "rslora", "mlp"):
        lora = None if name is None else adapters[name]
        outputs = lora_llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        picks[name] = [o.outputs[0].text for o in outputs]
        assert all(text in choices for text in picks[name])
    assert any(picks[name] != picks[None] for name in ("all", "rslora", "mlp"))


def test_gguf_adapters_equal_their_peft_originals(
    base: Path, lora_llm: LLM, adapters: dict[str, LoRARequest], prompts, expected, tmp_path: Path
) -> None:
    """The adapters as llama.cpp's convert_lora_to_gguf.py writes them (q/k B rows permuted
    for its RoPE), mixed with the base: the peft adapters' tokens."""
    from tokenmill_testing.lora_adapters import save_gguf_adapter

    loras = [
        LoRARequest(
            f"{name}-gguf",
            10 + i,
            str(save_gguf_adapter(adapters[name].lora_path, base, tmp_path / f"{name}.gguf")),
        )
        for i, name in enumerate(("all", "mlp"))
    ]
    got = generate_mixed(lora_llm, prompts, [None, *loras])
    assert got == {None: expected[None], "all-gguf": expected["all"], "mlp-gguf": expected["mlp"]}


def test_a_gguf_model_is_not_an_adapter(lora_llm: LLM, base: Path, prompts, tmp_path) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    request = LoRARequest("m", 11, str(tmp_path / "model.gguf"))
    with pytest.raises(InvalidRequestError, match="no GGUF LoRA adapter"):
        lora_llm.generate(prompts, greedy(), use_tqdm=False, lora_request=request)
