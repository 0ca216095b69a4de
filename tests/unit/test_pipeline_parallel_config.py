"""Pipeline parallelism's checks and split, without starting processes: the stages' layers,
which checkpoint tensors a stage loads, where a rank sits, and one-line refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill import LLM
from tokenmill.config import ConfigError, EngineConfig, SpeculativeConfig
from tokenmill.engine.hybrid import check_hybrid_config
from tokenmill.models.pipeline_split import PipelineStage, stage_holds, stage_layer_ranges
from tokenmill.worker.pipeline import RankPosition


def test_layers_split_evenly_first_stages_taking_the_rest() -> None:
    assert stage_layer_ranges(16, 2) == [(0, 8), (8, 16)]
    assert stage_layer_ranges(5, 3) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=3 is more than .* 2 decoder"):
        stage_layer_ranges(2, 3)


def test_a_stage_loads_its_own_tensors() -> None:
    def model(rank: int, tied: bool = False) -> SimpleNamespace:
        shape = SimpleNamespace(num_layers=4, tie_word_embeddings=tied)
        return SimpleNamespace(stage=PipelineStage(rank, 2), shape=shape)

    first, last = model(0), model(1)
    assert stage_holds(first, "model.layers.1.mlp.down_proj.weight")
    assert not stage_holds(first, "model.layers.2.mlp.down_proj.weight")
    assert stage_holds(last, "model.layers.3.self_attn.q_proj.weight")
    assert stage_holds(first, "model.embed_tokens.weight")
    assert not stage_holds(last, "model.embed_tokens.weight")
    assert stage_holds(model(1, tied=True), "model.embed_tokens.weight")  # the tied head
    assert not stage_holds(first, "lm_head.weight") and stage_holds(last, "lm_head.weight")
    assert not stage_holds(first, "model.norm.weight") and stage_holds(last, "model.norm.weight")


def test_rank_positions_as_vllm_numbers_them() -> None:
    positions = [RankPosition(rank, tp_size=2, pp_size=2) for rank in range(4)]
    assert [(p.pp_rank, p.tp_rank) for p in positions] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert positions[3].stage == PipelineStage(1, 2) and positions[3].stage.is_last
    assert positions[1].tensor_parallel().group is not None  # its stage's own group
    assert RankPosition(0, tp_size=2).tensor_parallel().group is None  # the default group


@pytest.mark.parametrize(
    ("options", "feature"),
    [
        ({"speculative_config": {"method": "ngram"}}, "speculative decoding"),
        ({"enforce_eager": False}, "captured decode steps"),
        ({"enable_lora": True}, "LoRA"),
        ({"quantization": "int8"}, "online quantization"),
        ({"pipeline_parallel_size": 0}, None),
    ],
)
def test_unsupported_features_are_refused(options: dict, feature: str | None) -> None:
    options = {"pipeline_parallel_size": 2, **options}
    if "speculative_config" in options:
        options["speculative_config"] = SpeculativeConfig.parse(options["speculative_config"])
    match = rf"does not support {feature}.*chunked prefill" if feature else "must be >= 1"
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**options)


def test_more_stages_than_layers_is_refused_before_any_rank_starts(tiny_checkpoint) -> None:
    checkpoint = tiny_checkpoint("llama")  # two layers
    with pytest.raises(ConfigError, match="more than the model's 2 decoder layers"):
        LLM(str(checkpoint), pipeline_parallel_size=3, dtype="float32")


def test_hybrid_models_are_refused() -> None:
    config = EngineConfig(pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        check_hybrid_config(config, "Qwen3NextForCausalLM")
