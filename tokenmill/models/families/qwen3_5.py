"""Qwen3.5 and Qwen3-Next: hybrid decoders of gated DeltaNet (linear attention) and gated full
attention layers (models/hybrid.py), with a per-sequence state cache beside the paged KV
(layers/linear_state.py; docs/hybrid_models.md). Qwen3-Next's MLPs are Qwen2-MoE blocks.

Registered here, on import by the loader (models/loader.py), not in the registry's built-in
list: the model class imports the shared decoder, which imports the registry.
"""

from __future__ import annotations

from tokenmill.models.family import Family
from tokenmill.models.hybrid import HybridForCausalLM, hybrid_traits, split_hybrid_tensor
from tokenmill.models.registry import register

QWEN3_5 = Family(
    name="qwen3_5",
    architectures=("Qwen3_5ForCausalLM",),
    traits=hybrid_traits,
    gguf_architectures=("qwen35",),
    split_tensor=split_hybrid_tensor,
    model_class=HybridForCausalLM,
)
QWEN3_NEXT = Family(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    traits=hybrid_traits,
    split_tensor=split_hybrid_tensor,
    model_class=HybridForCausalLM,
)
FAMILIES = (QWEN3_5, QWEN3_NEXT)
for _family in FAMILIES:
    register(_family)
