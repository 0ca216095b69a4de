"""The model registry: every family module (models/families/) under its name, looked up by a
checkpoint's config.json `architectures` or GGUF `general.architecture`.

Adding a family is one module in models/families/ and one entry in `_BUILTIN` (docs/
architecture.md, "Adding a model family"); a family defined elsewhere calls `register`.
"""

from __future__ import annotations

from tokenmill.models.families import gemma3, gpt_oss, llama, mixtral, phi3, qwen_moe
from tokenmill.models.family import Family

_BUILTIN = (llama.FAMILY, phi3.FAMILY, gemma3.FAMILY, mixtral.FAMILY, qwen_moe.FAMILY)
_BUILTIN += (gpt_oss.FAMILY,)
_BUILTIN += (gemma3.GEMMA2_FAMILY,)
_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> None:
    """Add a family; an architecture name belongs to one family only."""
    for other in _FAMILIES.values():
        shared = set(other.architectures) & set(family.architectures)
        if other.name != family.name and shared:
            raise ValueError(f"{sorted(shared)} already belong to the {other.name} family")
    _FAMILIES[family.name] = family


def families() -> list[Family]:
    return list(_FAMILIES.values())


def family_of(architecture: str) -> Family:
    """The family of a config.json architecture name (KeyError if none)."""
    for family in _FAMILIES.values():
        if architecture in family.architectures:
            return family
    raise KeyError(architecture)


def gguf_family(gguf_architecture: str, experts: bool = False) -> Family | None:
    """The family reading a GGUF `general.architecture` (`experts`: the file has
    `<architecture>.expert_count`); None if no family reads it."""
    for family in _FAMILIES.values():
        if gguf_architecture in family.gguf_architectures and family.mixture_of_experts == experts:
            return family
    return None


def gguf_architectures() -> list[str]:
    """What the families read from GGUF files, as an error message lists it."""
    return [
        f"{name} with {name}.expert_count" if family.mixture_of_experts else name
        for family in _FAMILIES.values()
        for name in family.gguf_architectures
    ]


for _family in _BUILTIN:
    register(_family)
