"""Which layout a GGUF layer's parts load into: the one that holds every part's blocks as they
are (gguf_file.py's `_format_of`), from the parts' types alone (no file needed)."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from tokenmill.quantization.gguf_file import _format_of
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
