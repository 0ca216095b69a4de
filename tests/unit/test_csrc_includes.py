"""The C++ kernels' files include one another without circles (a unit: `x.h` with `x.cpp`),
and the dense packed linear (`linear.{h,cpp}`) includes no weight format's files: each format's
kernels and its `PackedLinear` factory live in its own files (docs/quantization.md, "Adding a
weight format")."""

from __future__ import annotations

import re
from pathlib import Path

import tokenmill.kernels
from tokenmill_testing.import_graph import Import, import_circles

CSRC = Path(tokenmill.kernels.__file__).parent / "csrc"
_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)
# What the dense linear may include: what every kernel shares.
SHARED = {"cpu_common", "thread_pool"}


def include_graph(source_dir: Path = CSRC) -> list[Import]:
    """Unit -> unit edges of the quoted includes of every source and header."""
    edges = []
    for path in sorted(source_dir.glob("*.[ch]*")):
        text = path.read_text()
        for match in _INCLUDE.finditer(text):
            target = Path(match.group(1)).stem
            if target != path.stem:
                edges.append(Import(path.stem, target, text.count("\n", 0, match.start()) + 1))
    return edges


def test_the_sources_include_no_circle() -> None:
    assert import_circles(include_graph()) == []


def test_the_dense_linear_includes_no_weight_format() -> None:
    included = {edge.imported for edge in include_graph() if edge.importer == "linear"}
    assert included <= SHARED, f"linear.{{h,cpp}} includes {sorted(included - SHARED)}"


def test_the_checker_sees_a_circle(tmp_path: Path) -> None:
    """The checks above would pass on no sources; a header loop must be caught."""
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\n')
    (tmp_path / "b.h").write_text("#pragma once\n")
    (tmp_path / "b.cpp").write_text('#include "b.h"\n#include "a.h"\n')
    assert import_circles(include_graph(tmp_path)) == [["a", "b"]]
