"""The package imports only downwards through the layers of docs/architecture.md, with no
circles: a module moved or an import added against the grain fails here, not in review."""

from __future__ import annotations

import pytest

from tokenmill_testing.import_graph import (
    Import,
    import_circles,
    import_graph,
    layer_of,
    module_paths,
    upward_imports,
)


@pytest.fixture(scope="module")
def graph() -> list[Import]:
    return import_graph()


def test_every_module_has_a_layer() -> None:
    for name in module_paths():
        layer_of(name)  # raises for a module no layer covers


def test_no_module_imports_from_a_higher_layer(graph: list[Import]) -> None:
    upward = [f"{i.importer}:{i.line} -> {i.imported}" for i in upward_imports(graph)]
    assert upward == []


def test_no_import_circles(graph: list[Import]) -> None:
    assert import_circles(graph) == []


def test_the_checker_sees_upward_imports_and_circles() -> None:
    """The checks above would pass on an empty graph; these two edges must be caught."""
    engine_to_layers = Import("tokenmill.layers.attention", "tokenmill.engine.llm_engine", 1)
    back = Import("tokenmill.engine.llm_engine", "tokenmill.layers.attention", 1)
    assert upward_imports([engine_to_layers, back]) == [engine_to_layers]
    assert import_circles([engine_to_layers, back]) == [
        ["tokenmill.engine.llm_engine", "tokenmill.layers.attention"]
    ]


def test_the_graph_includes_imports_inside_functions(graph: list[Import]) -> None:
    # entrypoints/cli.py imports the bench and demo commands lazily, inside functions.
    assert any(i.importer == "tokenmill.entrypoints.cli" and "bench" in i.imported for i in graph)
