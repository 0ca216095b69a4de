"""The model registry: every family module (models/families/) under its name, looked up by a
checkpoint's config.json `architectures` or GGUF `general.architecture`.

Adding a family is one module in models/families/ and one entry in `_BUILTIN` (docs/
architecture.md, "Adding a model family"); a family defined elsewhere calls `register`.
"""

from __future__ import annotations

from tokenmill.models.families import gemma3, llama, phi3
from tokenmill.models.family import Family

_BUILTIN = (llama.FAMILY, phi3.FAMILY, gemma3.FAMILY)
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


def gguf_family(gguf_architecture: str) -> tuple[Family, str] | None:
    """The family reading a GGUF `general.architecture`, with the config.json architecture
    name it stands for (the family's first); None if no family reads it."""
    for family in _FAMILIES.values():
        if gguf_architecture in family.gguf_architectures:
            return family, family.architectures[0]
    return None


for _family in _BUILTIN:
    register(_family)
