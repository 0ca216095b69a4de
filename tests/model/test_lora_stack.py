"""Multi-LoRA inside the fused native decoder stack (csrc/decoder_stack.cpp with lora.cpp):
steps with adapter rows stay on the stack; greedy tokens equal transformers + peft in float32
at every ISA level this CPU runs (AVX-512 BF16, AVX-512, AVX2, portable through `set_isa`, as
TOKENMILL_CPU_ISA does); in bfloat16 the stack's prompt logprobs are close to the layer
modules' (the torch reference of the adapters)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.kernels import native
from tokenmill_testing.engines import make_llm
from tokenmill_testing.lora_adapters import merged_reference, save_random_adapter
from tokenmill_testing.transformers_reference import greedy_reference

module = native.native_kernels()
pytestmark = pytest.mark.skipif(module is None, reason="native kernels not buildable here")
LEVELS = list(range(module.detect_isa() + 1)) if module is not None else []
MAX_TOKENS = 6
PROMPTS = [[5, 9, 17, 33, 65, 129, 257], [300, 12, 7, 7, 90, 41, 3, 8, 11, 500, 2, 64, 64], [77]]


@pytest.fixture(scope="module")
def base(tiny_checkpoint: Callable[..., Path]) -> Path:
    # Odd widths: the expand's masked tails and the shrink's remainders.
    return tiny_checkpoint(
        "qwen2",
        hidden_size=40,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=72,
    )


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("stack_adapters")
    settings = [{"rank": 8, "seed": 11}, {"rank": 4, "seed": 12, "targets": ("k_proj", "o_proj")}]
    return [
        LoRARequest(f"s{i}", i + 1, str(save_random_adapter(base, root / f"s{i}", **kwargs)))
        for i, kwargs in enumerate(settings)
    ]


@pytest.fixture(scope="module")
def expected(base: Path, adapters: list[LoRARequest]) -> list[list[list[int]]]:
    """Greedy tokens of each prompt under the base, then each adapter (peft, merged)."""
    result = []
    for request in [None, *adapters]:
        model = merged_reference(base, None if request is None else request.lora_path)
        result.append(greedy_reference(model, PROMPTS, MAX_TOKENS)[0])
    return result


@pytest.fixture(scope="module")
def float_llm(base: Path) -> LLM:
    return make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8)


def mixed(llm: LLM, adapters: list[LoRARequest], params: SamplingParams):
    """Every prompt under the base and every adapter, in one call (one step mixes them)."""
    loras = [lora for lora in [None, *adapters] for _ in PROMPTS]
    return llm.generate(PROMPTS * (len(adapters) + 1), params, use_tqdm=False, lora_request=loras)


def test_adapter_steps_run_the_stack_and_equal_peft_at_every_isa_level(
    float_llm: LLM, adapters: list[LoRARequest], expected, isa: int
) -> None:
    stack = float_llm.engine.runner.model.decoder_stack
    assert stack is not None and stack.lora_mapping is not None
    calls = []
    stack.native = _Spy(stack.native, lambda *args: calls.append(args[-1]))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = mixed(float_llm, adapters, params)
    finally:
        stack.native = stack.native.inner
    assert any(segments is not None for segments in calls)  # adapter rows went through it
    got = [list(o.outputs[0].token_ids) for o in outputs]
    want = [tokens for per_adapter in expected for tokens in per_adapter]
    assert got == want


def test_bfloat16_stack_is_close_to_the_layer_modules(
    base: Path, adapters: list[LoRARequest]
) -> None:
    """Teacher-forced prompt logprobs, every ISA level, against the layer modules (the base
    linears then the torch reference of the adapters) and each other; the adapters move them
    far more (by up to ~13 here; the stack's and the modules' bf16 roundings by ~0.13)."""
    llm = make_llm(base, dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=8)
    model = llm.engine.runner.model
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs() -> torch.Tensor:
        values = []
        for output in mixed(llm, adapters, params):
            for position in output.prompt_logprobs[1:]:
                values.extend(entry.logprob for entry in position.values())
        return torch.tensor(values)

    stack = model.decoder_stack
    model.decoder_stack = None
    reference = logprobs()
    model.decoder_stack = stack
    per_adapter = reference.view(len(adapters) + 1, -1)
    assert (per_adapter[1:] - per_adapter[0]).abs().max() > 0.5  # the adapters matter
    best = module.get_isa()
    try:
        per_level = []
        for level in LEVELS:
            module.set_isa(level)
            per_level.append(logprobs())
    finally:
        module.set_isa(best)
    for got in per_level:  # the modules round each product to bf16, the stack keeps float32
        torch.testing.assert_close(got, reference, rtol=0.02, atol=0.05)
        torch.testing.assert_close(got, per_level[-1], rtol=0, atol=0.02)


def test_fused_parts_past_one_expand_block_equal_peft(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """q/k/v and gate/up wider than the expand's 256-column block, so that a block holds only
    some parts' columns and the expand skips the other parts' widths: an adapter on every part
    and one on k and up alone (whose widths are skipped where q's and gate's columns lie)."""
    base = tiny_checkpoint(
        "llama",
        hidden_size=40,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=64,  # q 320, k and v 64: columns 0-255 are q's alone
        intermediate_size=160,  # gate 0-159, up 160-319: columns 256-319 are up's alone
    )
    settings = [{"rank": 8, "seed": 21}, {"rank": 8, "seed": 22, "targets": ("k_proj", "up_proj")}]
    adapters = [
        LoRARequest(f"w{i}", i + 1, str(save_random_adapter(base, tmp_path / f"w{i}", **kwargs)))
        for i, kwargs in enumerate(settings)
    ]
    want = []
    for request in [None, *adapters]:
        model = merged_reference(base, None if request is None else request.lora_path)
        want.extend(greedy_reference(model, PROMPTS, MAX_TOKENS)[0])
    llm = make_llm(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    stack = llm.engine.runner.model.decoder_stack
    assert stack is not None and stack.lora_mapping is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in mixed(llm, adapters, params)]
    assert got == want


class _Spy:
    """The native stack with its `forward` calls' arguments seen first."""

    def __init__(self, inner, seen) -> None:
        self.inner, self.seen = inner, seen

    def forward(self, *args):
        self.seen(*args)
        return self.inner.forward(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)
