"""The registry of weight formats (quantization/selection.py's WEIGHT_FORMATS): every format
name a checkpoint or `--quantization` declares reaches its format's method through it, and a
format registered there is all the plan needs."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.layers.linear import DenseLinearMethod, LinearMethod
from tokenmill.quantization import selection
from tokenmill.quantization.int4 import Int4LinearMethod, int4_linear_available
from tokenmill.quantization.int8 import Int8LinearMethod
from tokenmill.quantization.selection import LinearPlan, log_plan
from tokenmill.quantization.weight_format import WeightFormat

CPU = torch.device("cpu")
LAYER = "layers.0.mlp.down_proj"


def plan_for(fmt: str, linear_backend: str = "torch") -> LinearPlan:
    """A plan giving `LAYER` format `fmt` (`torch`: torch's ops, so no kernel is needed)."""
    return LinearPlan(torch.float32, CPU, linear_backend, formats={LAYER: fmt})


@pytest.mark.parametrize(
    ("fmt", "method_type"),
    [
        ("int8", Int8LinearMethod),
        ("int8-g32", Int8LinearMethod),
        ("int5-g32", Int8LinearMethod),
        ("int6-g16", Int8LinearMethod),
        ("int4-g32", Int4LinearMethod),
        ("int4-g64", Int4LinearMethod),
        ("int4-g128", Int4LinearMethod),
    ],
)
def test_each_format_name_gets_its_formats_method(fmt: str, method_type: type) -> None:
    method = plan_for(fmt).method(LAYER, 64, 256)
    assert type(method) is method_type
    assert method.weight_format == fmt
    assert method.dequantize_on == CPU  # `--linear-backend torch`: torch's ops


@pytest.mark.parametrize("fmt", ["int9-g32", "int7-g32", "fp4", "int4"])
def test_an_unregistered_format_name_is_a_config_error(fmt: str) -> None:
    with pytest.raises(ConfigError, match="unknown weight format"):
        plan_for(fmt).method(LAYER, 64, 256)


class ToyMethod(DenseLinearMethod):
    weight_format = "toy-8"


class ToyFormat(WeightFormat):
    """A format whose kernel takes only weights with an even number of input columns."""

    family = "toy"
    fallback = "int8"

    def owns(self, name: str) -> bool:
        return name == "toy-8"

    def kernel_available(self) -> bool:
        return True

    def method(self, name: str, dequantize_on: torch.device | None) -> LinearMethod:
        return ToyMethod()

    def fits(
        self, name: str, out_features: int, in_features: int, dequantize_on: torch.device | None
    ) -> bool:
        return in_features % 2 == 0


def test_a_registered_format_is_all_the_plan_needs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(selection, "WEIGHT_FORMATS", (*selection.WEIGHT_FORMATS, ToyFormat()))
    plan = plan_for("toy-8")
    assert isinstance(plan.method(LAYER, 64, 256), ToyMethod)
    # A shape its kernel cannot take: the fallback format's method, logged.
    fallback = plan.method(LAYER, 64, 255)
    assert isinstance(fallback, Int8LinearMethod) and fallback.weight_format == "int8"
    assert plan.instead == {("toy", "int8"): [f"{LAYER} (64x255)"]}
    plan.default = "toy-8"  # log_plan speaks only for a quantized plan
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(4, 4)
    with caplog.at_level(logging.INFO, logger=selection.__name__):
        log_plan(plan, model)
    assert f"int8 instead of toy for 1 linears whose shape the toy kernel cannot take: {LAYER}" in (
        caplog.text
    )


@pytest.mark.skipif(not int4_linear_available(), reason="no int4 kernel in this torch")
def test_an_int4_layer_its_kernel_cannot_take_gets_int8_per_row() -> None:
    plan = plan_for("int4-g32", linear_backend="auto")
    assert isinstance(plan.method(LAYER, 64, 256), Int4LinearMethod)
    method = plan.method(LAYER, 64, 48)  # 48 columns: not whole groups of 32
    assert type(method) is Int8LinearMethod and method.weight_format == "int8"
    assert plan.instead == {("int4", "int8"): [f"{LAYER} (64x48)"]}


def test_quantization_choices_are_the_registered_online_formats() -> None:
    """`--quantization`'s choices (config/, below the formats) name what the formats serve."""
    (field,) = (f for f in dataclasses.fields(EngineConfig) if f.name == "quantization")
    assert set(field.metadata["choices"]) == set(selection.ONLINE_FORMATS)
    for value, fmt in selection.ONLINE_FORMATS.items():
        assert selection.online_format(value) == fmt
        assert selection.find_format(fmt) is not None
