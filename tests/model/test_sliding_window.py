"""Model-wide and per-layer sliding windows of the Llama line (Mistral's `sliding_window`,
Qwen2's `use_sliding_window` with `max_window_layers`) against transformers, with prompts
longer than the window, chunked prefill, prefix hits and preemption: the window's KV groups
(layers/kv_groups.py, core/kv/window_groups.py) give back the blocks behind the window."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 8
WINDOW = 8
# name: (architecture, config, KV blocks)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any], int]] = {
    # Every layer within the window: the primary table itself frees blocks behind it, so 7
    # blocks (28 tokens) serve the batch without preempting, where full attention would need
    # 15 blocks a request.
    "mistral": ("mistral", {"sliding_window": WINDOW}, 7),
    # The full-attention layer's blocks fill the pool: some requests preempt.
    # Layer 0 attends to everything, layers 1 and 2 within the window.
    "qwen2": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        27,
    ),
}
# The fused native stack (the CPU default) and the layer modules with torch's kernels.
PATHS = {"native": {}, "modules": {"attention_backend": "torch", "linear_backend": "torch"}}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_windowed_layers_free_blocks_and_equal_transformers(
    tiny_checkpoint, name: str, path: str, preemption_mode: str
) -> None:
    architecture, kwargs, num_kv_blocks = CHECKPOINTS[name]
    checkpoint = tiny_checkpoint(architecture, num_hidden_layers=3, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = random.Random(5)
    head = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [[*head, *(rng.randrange(3, vocab) for _ in range(n))] for n in (4, 9, 2)]
    expected, _ = greedy_reference(model, prompts, MAX_TOKENS)
    llm = LLM(
        model=str(checkpoint),
        dtype="float32",
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_model_len=64,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        preemption_mode=preemption_mode,
        swap_space=0.001,
        **PATHS[path],
    )
    manager = llm.engine.kv_cache_manager
    # The windowed layers' own block tables, or (every layer windowed) the primary's window.
    assert manager.groups is not None or manager.window == WINDOW
    held = HeldBlocks(manager)
    assert (llm.engine.runner.model.decoder_stack is not None) == (path == "native")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    rest = [o.outputs[0].token_ids for o in llm.generate(prompts[1:], greedy, use_tqdm=False)]
    assert [first, *rest] == expected
    stats = llm.get_stats().scheduler
    assert stats.prefix_cache.hits > 0
    assert (stats.num_preemptions > 0) == (manager.groups is not None)
    assert manager.num_free_blocks == manager.num_blocks - 1  # all back but the null block
    # A request of up to 57 tokens holds up to 15 blocks of 4 in a full-attention primary
    # table (Qwen2's, beside its windowed groups); a windowed one at most the window's.
    assert (held.most <= 6) == (manager.groups is None)


class HeldBlocks:
    """The most primary-table blocks one request held after an allocation."""

    def __init__(self, manager: Any) -> None:
        self.most = 0
        allocate = manager.allocate_slots

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            result = allocate(request, *args, **kwargs)
            blocks = manager.held(manager.req_to_blocks.get(request.sample_id, []))
            self.most = max(self.most, len(blocks))
            return result

        manager.allocate_slots = counting


def test_use_sliding_window_is_refused_where_no_family_reads_it(tiny_checkpoint) -> None:
    from tokenmill.config import ConfigError

    checkpoint = tiny_checkpoint(
        "qwen3_moe", num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW
    )
    with pytest.raises(ConfigError, match="use_sliding_window is served for Qwen2 and Qwen3"):
        LLM(model=str(checkpoint), dtype="float32", max_model_len=64)
