"""MTP speculation (`{"method": "mtp"}`): a checkpoint's own multi-token-prediction layer in
DeepSeek-V3's and Qwen3-Next's layouts (random weights beside a tiny target). Greedy outputs
identical to no speculation (chunked prefill, preemption, adaptive k); the drafts are the
layer's greedy chain recomputed from scratch; sampled outputs distributed as the target's
(chi-square); a checkpoint without MTP layers is a clear error."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.model.test_spec_decode import (
    PROMPT,
    VOCAB,
    chi_square,
    chi_square_critical,
    target_joint,
)
from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.spec_decode import eagle
from tokenmill_testing.random_heads import random_mtp

PROMPTS = [[5, 6, 7, 8, 9] * 3, [100, 200, 300], list(range(40, 70))]
VARIANTS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 16, "block_size": 4},
    "preempting": {"num_kv_blocks": 18, "block_size": 4, "max_model_len": 64},
}


@pytest.fixture(scope="module")
def mtp_checkpoints(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """(layout / architecture) -> a tiny checkpoint with a random MTP layer."""
    root = tmp_path_factory.mktemp("mtp")
    llama, qwen3 = tiny_checkpoint("llama", seed=3), tiny_checkpoint("qwen3", seed=3)
    return {
        "deepseek": random_mtp(llama, root / "deepseek", "deepseek"),
        "qwen3_next": random_mtp(llama, root / "qwen3_next", "qwen3_next"),
        "qwen3": random_mtp(qwen3, root / "qwen3", "deepseek"),  # q/k norms in the layer
    }


def _greedy(model: Path, spec: dict | None, **engine) -> tuple[list[list[int]], LLM]:
    engine = {"max_model_len": 96, **engine}
    llm = LLM(model=str(model), dtype="float32", speculative_config=spec, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm


@pytest.mark.parametrize(
    "checkpoint, variant, adaptive",
    [
        ("deepseek", "plain", False),
        ("deepseek", "chunked", True),
        ("deepseek", "preempting", False),
        ("qwen3_next", "plain", False),
        ("qwen3_next", "preempting", True),
        ("qwen3", "chunked", False),
    ],
)
def test_greedy_output_is_identical_with_mtp(mtp_checkpoints, checkpoint, variant, adaptive):
    """The target loads from the same directory (its MTP tensors skipped); the layer drafts."""
    model = mtp_checkpoints[checkpoint]
    reference, _ = _greedy(model, None)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": adaptive}
    outputs, llm = _greedy(model, spec, **VARIANTS[variant])
    assert outputs == reference
    stats = llm.get_stats().scheduler
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0
    if variant == "preempting":
        assert stats.num_preemptions > 0
    manager = llm.engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks, "rollback leaked blocks"


def _mtp_reference(model: Path, target, token_ids: list[int], k: int, deepseek: bool) -> list[int]:
    """Greedy MTP drafts after `token_ids` in plain torch: the layer over the whole sequence
    (causal, no cache) on transformers' features, each draft's token and feature appended."""
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = target.config
    prefix = f"model.layers.{config.num_hidden_layers}." if deepseek else "mtp."
    w = {n.removeprefix(prefix): t for n, t in load_file(str(model / "mtp.safetensors")).items()}
    if not deepseek:
        w = {n.removeprefix("layers.0."): t for n, t in w.items()}
        names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden"}
        w |= {f"{k}.weight": w[f"{v}.weight"] for k, v in names.items()}
        w |= {"eh_proj.weight": w["fc.weight"]}
    else:
        w |= {"norm.weight": w["shared_head.norm.weight"]}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    eps = config.rms_norm_eps

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w[f"{name}.weight"], eps)

    with torch.no_grad():
        features = target.model(torch.tensor([token_ids])).last_hidden_state[0, :-1]
        ids, drafts = list(token_ids), []
        for _ in range(k):
            n = features.shape[0]
            embeds = target.model.embed_tokens(torch.tensor(ids[1 : n + 1])).clone()
            if deepseek:
                embeds[0] = 0  # position 0, as vLLM's DeepSeek MTP
            x = torch.cat([norm(embeds, "enorm"), norm(features, "hnorm")], -1)
            x = x @ w["eh_proj.weight"].T
            cos, sin = LlamaRotaryEmbedding(config)(x[None], torch.arange(n)[None])
            normed = norm(x, "input_layernorm")
            q, key, value = (
                (normed @ w[f"self_attn.{name}_proj.weight"].T).view(1, n, h, dim).transpose(1, 2)
                for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))
            )
            q, key = apply_rotary_pos_emb(q, key, cos, sin)
            out = F.scaled_dot_product_attention(q, key, value, is_causal=True, enable_gqa=True)
            x = x + out.transpose(1, 2).reshape(n, -1) @ w["self_attn.o_proj.weight"].T
            normed = norm(x, "post_attention_layernorm")
            gate, up = normed @ w["mlp.gate_proj.weight"].T, normed @ w["mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
            drafts.append(int(target.lm_head(norm(x[-1], "norm")).argmax()))
            ids.append(drafts[-1])
            fed = x[-1:] if deepseek else norm(x[-1:], "norm")
            features = torch.cat([features, fed])
    return drafts


@pytest.mark.parametrize("layout", ["deepseek", "qwen3_next"])
def test_mtp_drafts_are_the_layers_greedy_chain(mtp_checkpoints, layout, monkeypatch) -> None:
    """The proposer's k drafts (catch-up through the paged cache, then the chain) equal the
    layer's chain recomputed from scratch, for requests of different lengths in one batch."""
    from transformers import LlamaForCausalLM

    seen: list[tuple[list[int], list[int]]] = []
    propose = eagle.EagleProposer.propose

    def recording_propose(self, states, num_tokens):
        proposals = propose(self, states, num_tokens)
        seen.extend(
            (list(s.token_ids), proposals[s.req_id]) for s in states if s.req_id in proposals
        )
        return proposals

    monkeypatch.setattr(eagle.EagleProposer, "propose", recording_propose)
    k, model = 3, mtp_checkpoints[layout]
    spec = {
        "method": "mtp",
        "num_speculative_tokens": k,
        "adaptive": False,
        "draft_weights": "full",
    }
    _greedy(model, spec)
    target = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    checked = seen[:: max(1, len(seen) // 6)]
    assert len(checked) >= 4 and any(len(drafts) == k for _, drafts in checked)
    for token_ids, drafts in checked:
        expected = _mtp_reference(model, target, token_ids, k, layout == "deepseek")
        assert drafts == expected[: len(drafts)]


@pytest.mark.slow(reason="a statistical test: thousands of samples")
def test_sampled_tokens_follow_the_target_distribution_with_mtp(tiny_checkpoint, tmp_path) -> None:
    n = 3000
    target = tiny_checkpoint("llama", vocab_size=VOCAB, seed=5)
    model = random_mtp(target, tmp_path / "mtp", "deepseek")
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(
        model=str(model),
        dtype="float32",
        speculative_config=spec,
        max_model_len=128,
        max_num_seqs=16,  # every request's catch-up fits the step's budget: all draft
        max_num_batched_tokens=4096,
    )
    # A flatter target than at temperature 1 (this one is peaked), so more drafts pass.
    params = SamplingParams(temperature=1.5, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([PROMPT] * n, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids[:2]) for o in outputs)
    stats = llm.get_stats().scheduler.spec_decode
    assert stats.num_draft_tokens > n / 2, "the second token should mostly come from verification"
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    statistic, dof = chi_square(counts, target_joint(str(target), 1.5, 1.0), n)
    assert dof >= 4
    assert statistic < chi_square_critical(dof)


def test_a_checkpoint_without_mtp_layers_is_a_clear_error(tiny_checkpoint) -> None:
    model = tiny_checkpoint("llama")
    with pytest.raises(ConfigError, match="has no MTP layers"):
        LLM(model=str(model), dtype="float32", speculative_config={"method": "mtp"})
