"""What a pipeline-parallel stage holds of the model: a contiguous run of decoder layers, the
embedding on the first stage, the final norm and the LM head on the last (as vLLM splits).

Layers keep their global indices (`layers.{i}`, so checkpoint names map as they are); a layer
another stage runs is a `PPMissingLayer`, which holds nothing and is never called.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from tokenmill.config import ConfigError

_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class PipelineStage:
    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's layers: an even split, the first stages taking one
        more where it does not divide."""
        return stage_layer_ranges(num_layers, self.size)[self.rank]


WHOLE = PipelineStage()


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Every stage's [start, end) of `num_layers` decoder layers."""
    if num_layers < num_stages:
        raise ConfigError(
            f"pipeline_parallel_size={num_stages} is more than the model's {num_layers} "
            "decoder layers: each stage needs at least one"
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class PPMissingLayer(nn.Module):
    """A part of the model another pipeline stage holds: no weights, never run."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("this part of the model lives on another pipeline stage")


def stage_holds(model: nn.Module, name: str) -> bool:
    """Whether `model` (a `LlamaForCausalLM`, maybe one pipeline stage of it) loads checkpoint
    tensor `name` (`model.`-prefixed or not)."""
    stage: PipelineStage = getattr(model, "stage", WHOLE)
    if stage.size == 1:
        return True
    match = _LAYER_NAME.search(name)
    if match is not None:
        start, end = stage.layer_range(model.shape.num_layers)
        return start <= int(match.group(1)) < end
    if "embed_tokens." in name:  # the last stage's tied head is the embedding's rows
        return stage.is_first or (stage.is_last and model.shape.tie_word_embeddings)
    if "lm_head." in name or name.removeprefix("model.").startswith("norm."):
        return stage.is_last
    return True
