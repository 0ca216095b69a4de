"""A decode step with one deep-context row among short ones, for issue 19's
SmolLM2-135M-shaped model (fp32): 32 decodes at 64 positions, the same plus one decode at
3,500, and that one alone; medians of 5 timed synthetic steps each.

    python benchmarks/mixed_context_decode.py
"""

from __future__ import annotations

import statistics

from itl_under_prefill import smollm2_shaped_model

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.worker.calibration import _Row, _run


def main() -> None:
    config = EngineConfig(model=str(smollm2_shaped_model()), dtype="float32", max_model_len=8192)
    engine = LLMEngine(config)
    decodes = [_Row(64, 1)] * 32

    def median_step(rows: list[_Row], tag: str) -> float:
        return statistics.median(_run(engine.runner, rows, f"{tag}-{i}") for i in range(5))

    short = median_step(decodes, "short")
    mixed = median_step([_Row(3500, 1), *decodes], "mixed")
    deep = median_step([_Row(3500, 1)], "deep")
    print(
        f"32 decodes at 64: {1000 * short:.0f} ms; plus one decode at 3,500: "
        f"{1000 * mixed:.0f} ms; that one alone: {1000 * deep:.0f} ms"
    )


if __name__ == "__main__":
    main()
