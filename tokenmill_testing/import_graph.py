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
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# Lowest first. A module belongs to the layer of its longest matching prefix and may import
# only from its own layer or the layers below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    # values every layer shares: settings, requests, sampling parameters, outputs
    (
        "tokenmill.version",
        "tokenmill.openmp",
        "tokenmill.config",
        "tokenmill.sampling_params",
        "tokenmill.outputs",
        "tokenmill.structured_output.request_grammar",  # a request's matcher
    ),
    ("tokenmill.metrics",),  # stats records, Prometheus, the stats line
    ("tokenmill.kernels",),  # native CPU kernels (C++ built at first use) and their loader
    ("tokenmill.layers",),  # KV-cache tensors, attention, linear, rotary, sampler
    ("tokenmill.quantization",),  # which method each linear gets; GGUF files
    ("tokenmill.models",),
    ("tokenmill.structured_output",),  # grammars (xgrammar) and the step's bitmask
    # a step's vocabulary: requests as scheduler and runner see them, the scheduler's output
    ("tokenmill.step",),
    # scheduler, KV-cache manager, block pool; the KV connectors the scheduler and runner call
    ("tokenmill.core", "tokenmill.kv_transfer"),
    ("tokenmill.spec_decode",),
    ("tokenmill.worker",),  # the runner, which uses proposers and verification
    ("tokenmill.engine", "tokenmill.structured_output.manager"),
    ("tokenmill_testing",),  # random checkpoints, this checker
    ("tokenmill.demo",),  # the demo models: where they are, their corpus, their eval
    # the offline API, which fills in the demo models where no model is given
    ("tokenmill.entrypoints.llm", "tokenmill.entrypoints.default_model"),
    ("tokenmill.bench", "demo_training.acceptance"),  # measurements through the APIs
    # the CLI and the server
    ("tokenmill.entrypoints",),
    ("tokenmill",),  # the package's public names (`from tokenmill import LLM`)
)


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
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not matches:
        raise ValueError(f"{module} is in no layer of LAYERS")
    return max(matches)[1]


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
    upward = upward_imports(graph)
    print(f"{len(module_paths())} modules, {len(graph)} imports between them")
    print(f"import circles: {len(circles)}")
    for circle in circles:
        print("  " + " <-> ".join(circle))
    print(f"upward imports: {len(upward)}")
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
