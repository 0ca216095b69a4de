"""Which layout a GGUF layer's parts load into: the one that holds every part's blocks as they
are (gguf_file.py's `_format_of`), from the parts' types alone (no file needed)."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from tokenmill.quantization.gguf_file import _format_of, _fused_format
from tokenmill.quantization.selection import find_format


@pytest.mark.parametrize(
    ("types", "expected"),
    [
        ({Q.IQ4_XS}, "iq4nl-g32"),
        ({Q.IQ4_NL, Q.IQ4_XS}, "iq4nl-g32"),
        ({Q.IQ4_XS, Q.Q6_K}, "int8-g16"),  # IQ4 values need 8 bits beside another type
        ({Q.Q3_K}, "int3-g16"),
        ({Q.Q2_K}, "int2-g16"),
        ({Q.Q2_K, Q.Q3_K}, "int3-g16"),
        ({Q.Q3_K, Q.Q4_K}, "int4-g16"),  # Q4_K's groups of 32 as two of 16
        ({Q.Q2_K, Q.Q4_K}, "int4-g16"),
        ({Q.Q3_K, Q.Q5_K}, "int5-g16"),
        ({Q.Q4_K, Q.Q6_K}, "int6-g16"),
        ({Q.Q4_K, Q.F16}, "float"),
    ],
    ids=lambda value: "+".join(sorted(t.name for t in value)) if isinstance(value, set) else value,
)
def test_mixed_parts_take_the_widest_codes_in_the_smallest_groups(types, expected) -> None:
    assert _format_of(types) == expected
    assert expected == "float" or find_format(expected) is not None  # a format owns the name


@pytest.mark.parametrize(
    ("part_types", "expected"),
    [
        ([Q.Q4_K, Q.Q4_K, Q.Q4_K], "int4-g32"),
        ([Q.Q4_K, Q.Q4_0], "int4-g32"),  # one layout holds both as they are
        ([Q.Q4_K, Q.Q4_K, Q.Q6_K], "int4-g32+int4-g32+int6-g16"),
        ([Q.IQ4_XS, Q.IQ4_XS, Q.Q5_K], "iq4nl-g32+iq4nl-g32+int5-g32"),
        ([Q.Q3_K, Q.Q4_K], "int3-g16+int4-g32"),
        ([Q.Q4_K, Q.Q4_K, Q.F16], "float"),
    ],
    ids=lambda value: "+".join(t.name for t in value) if isinstance(value, list) else value,
)
def test_a_fused_layer_holds_each_part_in_its_own_format(part_types, expected) -> None:
    """Parts of different layouts are held each in its own (mixed_parts.py), not all at the
    widest part's width."""
    assert _fused_format(part_types) == expected
    assert expected == "float" or find_format(expected) is not None
