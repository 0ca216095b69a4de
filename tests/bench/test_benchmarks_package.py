"""benchmarks/ is a package run from the repository's root (`python -m benchmarks.X`): every
module imports as `benchmarks.…`, and no benchmark or test edits `sys.path` to find another
(pytest's `pythonpath = ["."]` and `python -m` from the root put the root there)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import benchmarks

ROOT = Path(benchmarks.__file__).parents[1]


def test_every_benchmark_module_imports_from_the_package() -> None:
    failed = []
    for module in pkgutil.walk_packages(benchmarks.__path__, "benchmarks."):
        if module.name.endswith("__main__"):
            continue  # runs its command
        try:
            importlib.import_module(module.name)
        except Exception as e:
            failed.append(f"{module.name}: {type(e).__name__}: {e}")
    assert failed == []


def _edits_sys_path(tree: ast.AST) -> bool:
    """`sys.path.insert(...)` and the like, or `sys.path` assigned; not text in a string."""
    for node in ast.walk(tree):
        target = node.value if isinstance(node, ast.Attribute | ast.Subscript) else None
        if (
            isinstance(target, ast.Attribute)
            and target.attr == "path"
            and isinstance(target.value, ast.Name)
            and target.value.id == "sys"
        ):
            return True
    return False


def test_no_benchmark_or_test_edits_sys_path() -> None:
    files = [*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    editing = [str(f.relative_to(ROOT)) for f in files if _edits_sys_path(ast.parse(f.read_text()))]
    assert editing == []
