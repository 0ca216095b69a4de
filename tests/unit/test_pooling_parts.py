"""The pooling room's parts without a model: reading sentence-transformers' pooling files,
`--task auto`, the poolers over flat rows, the pooling engine's batching under its budgets."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tokenmill.pooling.config import (
    PoolingConfigError,
    read_pooling_config,
    resolve_task,
)
from tokenmill.pooling.engine import PoolingEngine, PoolingRequest
from tokenmill.pooling.poolers import finish_embedding, pool
from tokenmill.pooling.runner import PoolingInput

CONFIG = SimpleNamespace()


def _st_dir(tmp_path: Path, pooling: dict, normalize: bool = True, arch: str = "BertModel") -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "x.Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "x.Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "x.Normalize"})
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return tmp_path


@pytest.mark.parametrize(
    "pooling, expected",
    [
        ({"pooling_mode": "lasttoken"}, "last"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
        ({"pooling_mode_mean_tokens": True}, "mean"),
    ],
)
def test_sentence_transformers_pooling_modes(tmp_path: Path, pooling: dict, expected: str) -> None:
    config = read_pooling_config(_st_dir(tmp_path, pooling), CONFIG, is_decoder=False)
    assert (config.pooling_type, config.normalize) == (expected, True)


def test_unsupported_pooling_is_a_clear_error(tmp_path: Path) -> None:
    path = _st_dir(tmp_path, {"pooling_mode_max_tokens": True})
    with pytest.raises(PoolingConfigError, match="exactly one of cls, mean or last-token"):
        read_pooling_config(path, CONFIG, is_decoder=False)


def test_plain_directories_take_vllm_defaults(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path, CONFIG, is_decoder=False).pooling_type == "cls"
    decoder = read_pooling_config(tmp_path, CONFIG, is_decoder=True)
    assert (decoder.pooling_type, decoder.normalize) == ("last", True)


@pytest.mark.parametrize(
    "architecture, sentence_transformers, task",
    [
        ("BertModel", False, "embed"),
        ("Qwen3ForCausalLM", True, "embed"),
        ("Qwen3ForCausalLM", False, "generate"),
        ("BertForSequenceClassification", True, "score"),
    ],
)
def test_auto_task_from_the_checkpoint(
    tmp_path: Path, architecture: str, sentence_transformers: bool, task: str
) -> None:
    if sentence_transformers:
        _st_dir(tmp_path, {"pooling_mode": "cls"}, arch=architecture)
    else:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    assert resolve_task("auto", tmp_path) == task
    assert resolve_task("generate", tmp_path) == "generate"


def test_poolers_over_flat_rows() -> None:
    hidden = torch.arange(12.0).view(6, 2)  # sequences of 1, 2 and 3 rows
    lengths = torch.tensor([1, 2, 3])
    assert pool(hidden, lengths, "cls").tolist() == [[0, 1], [2, 3], [6, 7]]
    assert pool(hidden, lengths, "last").tolist() == [[0, 1], [4, 5], [10, 11]]
    assert pool(hidden, lengths, "mean").tolist() == [[0, 1], [3, 4], [8, 9]]
    cut = finish_embedding(torch.tensor([3.0, 4.0, 12.0]), normalize=True, dimensions=2)
    assert cut.tolist() == pytest.approx([0.6, 0.8])


class _RecordingRunner:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def run(self, inputs: list[PoolingInput]) -> list[torch.Tensor]:
        self.batches.append([len(i.token_ids) for i in inputs])
        return [torch.tensor(float(len(i.token_ids))) for i in inputs]


def test_engine_batches_under_the_token_budget_and_seq_cap() -> None:
    runner = _RecordingRunner()
    engine = PoolingEngine(runner, max_num_batched_tokens=10, max_num_seqs=3)  # type: ignore[arg-type]
    for i, size in enumerate([4, 4, 4, 1, 1, 1, 1, 20, 2]):
        engine.add(PoolingRequest(str(i), PoolingInput([1] * size)))
    results = []
    while engine.has_unfinished_requests():
        results += engine.step()
    # Arrival order; a step stops before the budget or the cap; a long one runs alone.
    assert runner.batches == [[4, 4], [1, 1, 4], [1, 1], [20], [2]]
    assert [r.request_id for r in results if r.num_prompt_tokens == 20] == ["7"]
    assert {r.request_id: float(r.data) for r in results}["2"] == 4.0
    assert engine.stats.num_requests == 9


def test_engine_refuses_empty_input() -> None:
    engine = PoolingEngine(_RecordingRunner(), 10, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one token"):
        engine.add(PoolingRequest("x", PoolingInput([])))


def test_attention_buckets_bound_padding_and_cover_every_token() -> None:
    from tokenmill.models.bert import MAX_PADDING_SHARE, attention_buckets

    lengths = sorted([3, 3, 3, 5, 8, 16, 17, 17, 40, 120, 128])
    buckets = attention_buckets(lengths, torch.device("cpu"))
    assert buckets[0].valid is None and buckets[0].count == 3  # equal lengths: no padding
    assert [b.start for b in buckets[1:]] == [b.end for b in buckets[:-1]]
    assert buckets[-1].end == sum(lengths) and sum(b.count for b in buckets) == len(lengths)
    for b in buckets:
        real = b.end - b.start
        assert b.count * b.longest <= (1 + MAX_PADDING_SHARE) * real
        if b.valid is not None:
            assert int(b.valid.sum()) == real
