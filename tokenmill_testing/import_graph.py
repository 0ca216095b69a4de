"""tokenmill's import graph, checked against its layering (docs/architecture.md, "Layers").

    python -m tokenmill_testing.import_graph

prints the import circles, the upward imports, the modules over 400 lines and the functions
over 60 lines. Every import counts, also those inside functions or under `TYPE_CHECKING`: each
is a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "tokenmill"
MAX_MODULE_LINES = 450  # issue 30: no module in tokenmill/ over this
MAX_FUNCTION_LINES = 60

# The layers, lowest first: each is one subpackage of tokenmill, which may import only from
# its own layer and those below it. Below them all: the package's own modules
# (sampling_params, outputs, version, openmp), values every layer shares; above them all:
# the package itself (`from tokenmill import LLM`).
LAYERS: tuple[str, ...] = (
    "config",  # EngineConfig and the JSON-valued settings: every knob, validated
    "metrics",  # stats records, Prometheus, the stats line
    "kernels",  # native CPU kernels (C++ built at first use) and their loader
    "layers",  # KV-cache tensors, attention/, Linear and the dense methods, rotary, sampler
    "quantization",  # the weight formats, which method each linear gets; their checkpoints
    "models",  # the model code and its loader
    "lora",  # peft adapters, the adapter store, LoRA layers around the model's linears
    "structured_output",  # grammars: validation, compiles, a request's matcher, the bitmask
    "step",  # a step's vocabulary: requests as scheduler and runner see them, the seam values
    "kv_transfer",  # KV connectors, which the scheduler and the runner call
    "core",  # KV memory, the feedback loop, scheduling: three rooms (ROOMS below)
    "spec_decode",  # proposers and verification
    "worker",  # the model runner (which calls proposers), tensor-parallel workers
    "engine",  # the step loop, its assembly, the output processor, the async engine
    "pooling",  # embeddings and scores: pooling configs, poolers, the lean pooling engine
    "demo",  # the built-in demo models: where they are, their corpus, their eval
    "bench",  # load generators and measurements (given an engine or a server)
    "entrypoints",  # the offline LLM, the CLI, the HTTP server, the router, the dashboard
)
BASE_LAYER = 0  # tokenmill's own modules
TOP_LAYER = len(LAYERS) + 1  # tokenmill/__init__.py

# Rooms inside a layer, lowest first: each is one subpackage of the layer, which may import
# from its own room and the rooms before it (and the layers below), never from a later one.
ROOMS: dict[str, tuple[str, ...]] = {
    # KV memory; the feedback loop (learned from measured steps: the cost model, the
    # speculation policy, the prefill budget); scheduling, which reads both.
    "core": ("kv", "feedback", "sched"),
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_paths() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: set[str]) -> Iterator[Import]:
    """The tokenmill modules `name` imports; `from package import submodule` names the
    submodule."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names
            ]
        else:
            continue
        for target in dict.fromkeys(targets):
            if target in modules and target != name:
                yield Import(name, target, node.lineno)


def import_graph() -> list[Import]:
    paths = module_paths()
    return [i for name, path in paths.items() for i in imports_of(name, path, set(paths))]


def layer_of(module: str) -> int:
    """1 + the index in LAYERS of the subpackage `module` is in; BASE_LAYER for the package's
    own modules, TOP_LAYER for the package itself."""
    parts = module.split(".")
    if parts[0] != "tokenmill":
        raise ValueError(f"{module} is not in tokenmill")
    if len(parts) == 1:
        return TOP_LAYER
    if (PACKAGE_DIR / f"{parts[1]}.py").is_file():
        return BASE_LAYER
    if parts[1] not in LAYERS:
        raise ValueError(f"{module} is in no layer: add tokenmill.{parts[1]} to LAYERS")
    return LAYERS.index(parts[1]) + 1


def room_of(module: str) -> int | None:
    """The index in its layer's ROOMS of the room `module` is in; None for a module of a
    layer without rooms, and for the layer's package itself."""
    parts = module.split(".")
    rooms = ROOMS.get(parts[1]) if len(parts) > 1 else None
    if rooms is None or len(parts) == 2:
        return None
    if parts[2] not in rooms:
        raise ValueError(f"{module} is in no room: add it to ROOMS[{parts[1]!r}]")
    return rooms.index(parts[2])


def imports_against_rooms(graph: list[Import]) -> list[Import]:
    """Imports within a layer from a later room than the importer's."""
    found = []
    for i in graph:
        if i.importer.split(".")[:2] != i.imported.split(".")[:2]:
            continue  # across layers: `upward_imports` judges those
        importer, imported = room_of(i.importer), room_of(i.imported)
        if importer is not None and imported is not None and imported > importer:
            found.append(i)
    return found


def subpackages() -> set[str]:
    return {p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").is_file()}


def upward_imports(graph: list[Import]) -> list[Import]:
    return [i for i in graph if layer_of(i.imported) > layer_of(i.importer)]


def import_circles(graph: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges: dict[str, list[str]] = {}
    for i in graph:
        edges.setdefault(i.importer, []).append(i.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                circles.append(sorted([node, *component]))

    for node in list(edges):
        if node not in index:
            visit(node)
    return circles


def long_modules(limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    lines = {name: len(path.read_text().splitlines()) for name, path in module_paths().items()}
    return {name: n for name, n in lines.items() if n > limit}


def long_functions(limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    found = {}
    for name, path in module_paths().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    found[f"{name}.{node.name}"] = length
    return found


def main() -> int:
    graph = import_graph()
    circles = import_circles(graph)
    upward = upward_imports(graph) + imports_against_rooms(graph)
    print(f"{len(module_paths())} modules, {len(graph)} imports between them")
    print(f"import circles: {len(circles)}")
    for circle in circles:
        print("  " + " <-> ".join(circle))
    print(f"upward imports (across layers or rooms): {len(upward)}")
    for i in upward:
        print(f"  {i.importer}:{i.line} -> {i.imported}")
    for title, found in (
        (f"modules over {MAX_MODULE_LINES} lines", long_modules()),
        (f"functions over {MAX_FUNCTION_LINES} lines", long_functions()),
    ):
        print(f"{title}: {len(found)}")
        for name, n in sorted(found.items(), key=lambda kv: -kv[1]):
            print(f"  {name}: {n}")
    return 1 if circles or upward else 0


if __name__ == "__main__":
    sys.exit(main())
