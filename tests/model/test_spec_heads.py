"""Speculative heads on the target (EAGLE, Medusa): greedy outputs identical with and without
them on the demo target with its shipped heads (chunked prefill, preemption, prefix hits);
sampled outputs distributed as the target's (chi-square, random heads on a small-vocabulary
model); heads load in vLLM's formats and a mismatched target is a clear error."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.model.test_spec_decode import (
    PROMPT,
    VOCAB,
    chi_square,
    chi_square_critical,
    target_joint,
)
from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.demo import demo_model_path
from tokenmill.spec_decode import eagle
from tokenmill_testing.random_heads import random_eagle, random_medusa

MAX_TOKENS = 24
CHATS = [
    "Repeat this text exactly:\nOnce upon a time, there was a little fox named Max.",
    "Reverse this list: apple banana cherry dog",
    "Sort these numbers: 31 5 77 12",
    "Tell me a story about a dog.",
]

ENGINE_VARIANTS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 16, "block_size": 4},
    "preempting": {"num_kv_blocks": 32, "block_size": 4},
}


@pytest.fixture(scope="module")
def demo_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_path("target"))
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c in CHATS
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def demo_llm(spec: dict | None, **kwargs) -> LLM:
    """The demo target (no model given: the entrypoint fills in target and heads)."""
    return LLM(dtype="float32", speculative_config=spec, max_model_len=128, **kwargs)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """In two waves, so the second hits the prefix cache."""
    first = llm.generate(prompts[:2], params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + second]


@pytest.fixture(scope="module")
def reference(demo_prompts) -> list[list[int]]:
    return generate(demo_llm(None), demo_prompts, greedy())


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
@pytest.mark.slow(reason="every engine variant with each head")
def test_greedy_output_is_identical_with_heads(demo_prompts, reference, method, variant) -> None:
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    llm = demo_llm(spec, **ENGINE_VARIANTS[variant])
    assert llm.engine.config.speculative_config.model == str(demo_model_path(method))
    assert generate(llm, demo_prompts, greedy()) == reference
    stats = llm.get_stats().scheduler
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0
    # The shipped heads draft from the right features (random ones are accepted ~never): on
    # these chats EAGLE's drafts are accepted at 0.40, Medusa's at 0.20 (heads of 800 steps;
    # the 100-step heads before them would not pass).
    bar = {"eagle": 0.3, "medusa": 0.15}[method]
    assert stats.spec_decode.num_accepted_tokens > bar * stats.spec_decode.num_draft_tokens
    assert stats.prefix_cache.hits > 0
    if variant == "preempting":
        assert stats.num_preemptions > 0
    manager = llm.engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks, "rollback leaked blocks"


class _StretchPolicy:
    """Eight steps without drafts, then four drafting 3 tokens: every return to drafting
    finds each request behind."""

    def __init__(self) -> None:
        self.calls = 0

    def choose(self, num_decodes: int) -> int:
        self.calls += 1
        return 3 if self.calls % 12 >= 8 else 0

    def observe(self, *args: object) -> None:
        pass


def test_eagle_catch_up_is_bounded_per_step(demo_prompts, reference, monkeypatch) -> None:
    """After steps without drafts, a proposal runs the EAGLE layer over at most the steady
    state's tokens plus CATCH_UP_EXTRA_TOKENS (requests further behind draft later), and a
    request holds at most 2 * FEATURE_WINDOW positions of features; outputs stay the
    target's."""
    module = "tokenmill.spec_decode.eagle"
    extra, window = 3, 6
    monkeypatch.setattr(f"{module}.CATCH_UP_EXTRA_TOKENS", extra)
    monkeypatch.setattr(f"{module}.FEATURE_WINDOW", window)
    monkeypatch.setattr(f"{module}.MAX_FEATURE_CHUNKS", 3)
    proposer_class = eagle.EagleProposer
    run_pieces, propose, record = (
        proposer_class._catch_up,
        proposer_class.propose,
        proposer_class.record_hidden_states,
    )
    caught_up: list[int] = []
    steps: list[tuple[int, int, int]] = []  # (tokens caught up, budget, tokens behind)

    def counting_pieces(self, pieces):
        caught_up.append(sum(p[2].shape[0] for p in pieces))
        return run_pieces(self, pieces)

    def counting_propose(self, states, num_tokens):
        behind = sum(
            len(s.token_ids) - 1 - max(s.num_draft_computed_tokens, s.draft_hidden[0][0])
            for s in states
            if s.draft_hidden
        )
        caught_up.clear()
        proposals = propose(self, states, num_tokens)
        steps.append((sum(caught_up), extra + (num_tokens + 1) * len(states), behind))
        return proposals

    def bounded_record(self, state, first_position, hidden):
        record(self, state, first_position, hidden)
        chunks = state.draft_hidden
        if chunks:
            assert chunks[-1][0] + chunks[-1][1].shape[0] - chunks[0][0] <= 2 * window

    monkeypatch.setattr(proposer_class, "_catch_up", counting_pieces)
    monkeypatch.setattr(proposer_class, "propose", counting_propose)
    monkeypatch.setattr(proposer_class, "record_hidden_states", bounded_record)
    llm = demo_llm({"method": "eagle", "num_speculative_tokens": 3})
    llm.engine.scheduler.spec_policy = _StretchPolicy()
    assert generate(llm, demo_prompts, greedy()) == reference
    assert all(tokens <= budget for tokens, budget, _ in steps), steps
    assert any(behind > budget for _, budget, behind in steps), "the budget never bound"
    stats = llm.get_stats().scheduler.spec_decode
    assert stats is not None and stats.num_draft_tokens > 0


def _eagle_reference(target, weights: dict, token_ids: list[int], k: int) -> list[int]:
    """Greedy EAGLE drafts after `token_ids`, recomputed from scratch in plain torch: the
    layer over the whole sequence (causal attention, no cache) on the target's features,
    each draft's token and predicted feature appended for the next."""
    import torch
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = target.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    w = {name.removeprefix("layers.0."): tensor for name, tensor in weights.items()}
    with torch.no_grad():
        features = target.model(torch.tensor([token_ids])).last_hidden_state[0, :-1]
        ids, drafts = list(token_ids), []
        for _ in range(k):
            n = features.shape[0]
            embeds = target.model.embed_tokens(torch.tensor(ids[1 : n + 1]))
            inputs = [embeds, features]
            if w["fc.weight"].shape[1] == 3 * config.hidden_size:  # fc reads token p too
                inputs.append(target.model.embed_tokens(torch.tensor(ids[:n])))
            x = torch.cat(inputs, -1) @ w["fc.weight"].T
            cos, sin = LlamaRotaryEmbedding(config)(x[None], torch.arange(n)[None])
            q, key, value = (
                (x @ w[f"self_attn.{name}_proj.weight"].T).view(1, n, h, dim).transpose(1, 2)
                for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))
            )
            q, key = apply_rotary_pos_emb(q, key, cos, sin)
            out = F.scaled_dot_product_attention(q, key, value, is_causal=True, enable_gqa=True)
            x = x + out.transpose(1, 2).reshape(n, -1) @ w["self_attn.o_proj.weight"].T
            normed = F.rms_norm(x, (x.shape[-1],), w["post_attention_layernorm.weight"], 1e-6)
            gate, up = normed @ w["mlp.gate_proj.weight"].T, normed @ w["mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
            drafts.append(int(target.lm_head(x[-1]).argmax()))
            ids.append(drafts[-1])
            features = torch.cat([features, x[-1:]])
    return drafts


@pytest.mark.slow(reason="the EAGLE layer re-run step by step")
def test_eagle_drafts_are_the_layers_greedy_chain(demo_prompts, monkeypatch) -> None:
    """The proposer's k drafts (catch-up through the paged cache, then the chain on its own
    keys) equal the layer's greedy chain recomputed from scratch, for requests of different
    lengths drafting in one batch."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    seen: list[tuple[list[int], list[int]]] = []  # (token ids when proposing, drafts)
    propose = eagle.EagleProposer.propose

    def recording_propose(self, states, num_tokens):
        proposals = propose(self, states, num_tokens)
        seen.extend(
            (list(s.token_ids), proposals[s.req_id]) for s in states if s.req_id in proposals
        )
        return proposals

    monkeypatch.setattr(eagle.EagleProposer, "propose", recording_propose)
    k = 4
    spec = {"method": "eagle", "num_speculative_tokens": k, "adaptive": False}
    llm = demo_llm({**spec, "draft_weights": "full"})  # int8 drafts differ from the reference
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(demo_prompts[:3], params, use_tqdm=False)
    heads = demo_model_path("eagle")
    target = LlamaForCausalLM.from_pretrained(demo_model_path("target"), dtype=torch.float32)
    weights = load_file(str(heads / "model.safetensors"))
    checked = seen[:: max(1, len(seen) // 8)]
    assert len(checked) >= 4 and any(len(drafts) == k for _, drafts in checked)
    for token_ids, drafts in checked:
        assert drafts == _eagle_reference(target, weights, token_ids, k)[: len(drafts)]


@pytest.fixture(scope="module")
def small_vocab_model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama", vocab_size=VOCAB, seed=5))


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.slow(reason="a statistical test: thousands of samples")
def test_sampled_tokens_follow_the_target_distribution(small_vocab_model, tmp_path, method) -> None:
    n = 3000
    make_heads = random_eagle if method == "eagle" else random_medusa
    heads = make_heads(small_vocab_model, tmp_path / method)
    spec = {"method": method, "model": str(heads), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(
        model=small_vocab_model,
        dtype="float32",
        speculative_config=spec,
        max_model_len=128,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
    )
    # Token 2 comes from verifying a draft (max_tokens 3 leaves room for one draft).
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([PROMPT] * n, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids[:2]) for o in outputs)
    stats = llm.get_stats().scheduler.spec_decode
    assert stats.num_draft_tokens > n / 2, "the second token should mostly come from verification"
    joint = target_joint(small_vocab_model, 1.0, 1.0)
    statistic, dof = chi_square(counts, joint, n)
    assert dof >= 4
    assert statistic < chi_square_critical(dof)


@pytest.fixture(scope="module")
def target(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.mark.parametrize(
    "method, original_names", [("eagle", False), ("medusa", False), ("medusa", True)]
)
def test_random_heads_load_and_leave_outputs_unchanged(
    target, tmp_path, method, original_names
) -> None:
    """vLLM's names (and the original Medusa repository's); a random head's drafts are mostly
    rejected, which exercises rollback."""
    if method == "eagle":
        heads = random_eagle(target, tmp_path / "eagle")
    else:
        heads = random_medusa(target, tmp_path / "medusa", original_names=original_names)
    prompts = [[5, 6, 7, 8, 9] * 3, [100, 200, 300]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=target, dtype="float32", max_model_len=64).generate(prompts, params)
    spec = {"method": method, "model": str(heads), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=target, dtype="float32", max_model_len=64, speculative_config=spec)
    fast = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_stats().scheduler.spec_decode.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_heads_of_another_target_are_a_clear_error(target, method) -> None:
    """The demo heads (hidden 256, vocabulary 2048) on a tiny random target."""
    spec = {"method": method, "model": str(demo_model_path(method))}
    with pytest.raises(ConfigError, match="heads only work on the model they were trained on"):
        LLM(model=target, dtype="float32", speculative_config=spec)


def test_other_targets_need_explicit_heads(target) -> None:
    with pytest.raises(ConfigError, match="needs a model path"):
        LLM(model=target, dtype="float32", speculative_config={"method": "eagle"})
