"""The package imports only downwards through the layers of docs/architecture.md (one
subpackage per layer, no exceptions), with no circles: a module moved or an import added
against the grain fails here, not in review."""

from __future__ import annotations

import ast

import pytest

from tokenmill_testing.import_graph import (
    LAYERS,
    ROOMS,
    Import,
    import_circles,
    import_graph,
    imports_against_rooms,
    layer_of,
    long_modules,
    module_paths,
    room_of,
    subpackages,
    upward_imports,
)


@pytest.fixture(scope="module")
def graph() -> list[Import]:
    return import_graph()


def test_every_module_has_a_layer() -> None:
    for name in module_paths():
        layer_of(name)  # raises for a module no layer covers


def test_the_layers_are_the_subpackages_each_once() -> None:
    assert sorted(LAYERS) == sorted(subpackages())


def test_the_package_imports_nothing_it_does_not_ship() -> None:
    """Test support, the demo training and the benchmark scripts live beside the package,
    not in the wheel."""
    outside = ("tokenmill_testing", "demo_training", "benchmarks")
    found = []
    for name, path in module_paths().items():
        for node in ast.walk(ast.parse(path.read_text())):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{name} -> {m}" for m in modules if m.split(".")[0] in outside]
    assert found == []


def test_no_module_imports_from_a_higher_layer(graph: list[Import]) -> None:
    upward = [f"{i.importer}:{i.line} -> {i.imported}" for i in upward_imports(graph)]
    assert upward == []


def test_every_module_of_a_layer_with_rooms_is_in_one() -> None:
    """core/ holds its modules in rooms (kv/, feedback/, sched/), none loose beside them."""
    for name in module_paths():
        room_of(name)  # raises for a module of such a layer outside its rooms
    modules = module_paths()
    named = {f"tokenmill.{layer}.{room}" for layer, rooms in ROOMS.items() for room in rooms}
    assert named == {m for m in modules if len(m.split(".")) == 3 and m.split(".")[1] in ROOMS}


def test_no_module_imports_from_a_later_room(graph: list[Import]) -> None:
    against = [f"{i.importer}:{i.line} -> {i.imported}" for i in imports_against_rooms(graph)]
    assert against == []


def test_the_checker_sees_imports_against_the_rooms() -> None:
    kv_to_sched = Import("tokenmill.core.kv.cache_manager", "tokenmill.core.sched.scheduler", 1)
    sched_to_kv = Import("tokenmill.core.sched.scheduler", "tokenmill.core.kv.cache_manager", 1)
    across = Import("tokenmill.engine.llm_engine", "tokenmill.core.sched.scheduler", 1)
    assert imports_against_rooms([kv_to_sched, sched_to_kv, across]) == [kv_to_sched]
    with pytest.raises(ValueError, match="no room"):
        room_of("tokenmill.core.loose_module")


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


def test_no_module_is_over_450_lines() -> None:
    """A module has one job and fits in a few screens (issue 30)."""
    assert long_modules(450) == {}


def test_the_http_transport_imports_no_protocol_room(graph: list[Import]) -> None:
    """entrypoints/http/transport/ is what every request passes through whatever its API (keys,
    limits, body checks, errors, event streams): it imports nothing else of the entrypoints,
    so each protocol room (openai/, anthropic/, responses/) and the router can sit on it."""
    transport = "tokenmill.entrypoints.http.transport"
    upward = [
        f"{i.importer}:{i.line} -> {i.imported}"
        for i in graph
        if i.importer.startswith(transport + ".")
        and i.imported.startswith("tokenmill.entrypoints.")
        and not i.imported.startswith(transport + ".")
    ]
    assert upward == []
