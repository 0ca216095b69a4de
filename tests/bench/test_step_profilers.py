"""benchmarks/steps at tiny sizes, so that the profilers do not rot: the engine's public
measurement accessors (`LLMEngine.step_phases`, `.model`, `.step_cost_coefficients`) resolve
to what the profilers wrap and read."""

from __future__ import annotations

import torch

from benchmarks.steps.outside_forward import PHASES, PhaseClock, measure
from tokenmill import LLM


def test_outside_forward_times_every_phase_through_the_engines_accessor(tiny_checkpoint) -> None:
    checkpoint = tiny_checkpoint("llama", vocab_size=2048)  # measure draws ids below 2000
    llm = LLM(model=str(checkpoint), max_model_len=256, dtype="float32")
    engine = llm.engine
    phases = engine.step_phases()
    assert {phase for phase, _, _ in phases} == set(PHASES)
    assert all(callable(getattr(owner, name)) for _, owner, name in phases)
    clock = PhaseClock()
    for phase, owner, name in phases:
        clock.wrap(owner, name, phase)
    row = measure(llm, clock, batch=2, steps=3, rounds=1)
    assert all(row[phase] > 0 for phase in PHASES), row
    assert isinstance(engine.model, torch.nn.Module)
    assert engine.step_cost_coefficients is None  # no ITL target: no calibrated cost model
