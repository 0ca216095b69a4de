"""docs/architecture.md against the tree: every package and every module of tokenmill/ is named
there, every file it names exists, and package docstrings that list their files list them all.

The rule for "named": a module's path relative to tokenmill/ in backticks (`core/scheduler.py`),
or, in a table row, its bare file name (`scheduler.py`) where the row's first cell names its
folder (the folder itself, `core/`, or a file in it, `core/block_pool.py`). A package is named
by its folder in backticks (`kv_transfer/p2p/`). Modules are the Python files and the native
kernels' C++ sources; `__init__.py` files are their package.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tokenmill"
DOC = ROOT / "docs" / "architecture.md"
SOURCE_SUFFIXES = (".py", ".cpp", ".h")
# What a backticked name must look like to be taken for a file or folder of the tree.
PATH_TOKEN = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
NAMED_SUFFIXES = (*SOURCE_SUFFIXES, ".md", ".toml")
BACKTICKED = re.compile(r"`([^`\n]+)`")


@dataclass
class DocNames:
    """What the document names: full paths (relative to tokenmill/ or the repository), and
    bare file names with the folders their table row gives them."""

    paths: set[str] = field(default_factory=set)
    folders: set[str] = field(default_factory=set)
    in_rows: set[str] = field(default_factory=set)  # folder/name from a row's bare names
    bare: set[str] = field(default_factory=set)  # bare names outside any row's folders


def relative(token: str) -> str:
    return token.removeprefix("tokenmill/")


def is_path(token: str) -> bool:
    if not PATH_TOKEN.match(token) or token.startswith(("/", ".")):
        return False
    return "/" in token or token.endswith(NAMED_SUFFIXES)


def row_folders(first_cell: str) -> list[str]:
    folders = []
    for token in BACKTICKED.findall(first_cell):
        if is_path(token) and "/" in token:
            token = relative(token)
            folders.append(token.rstrip("/") if token.endswith("/") else str(Path(token).parent))
    return folders


def read_doc(text: str) -> DocNames:
    names = DocNames()
    for line in text.splitlines():
        cells = line.split("|")[1:] if line.startswith("|") else []
        folders = row_folders(cells[0]) if cells else []
        for token in filter(is_path, BACKTICKED.findall(line)):
            if "/" in token:
                token = relative(token)
                (names.folders if token.endswith("/") else names.paths).add(token.rstrip("/"))
            elif folders:
                names.in_rows.update(f"{folder}/{token}" for folder in folders)
            else:
                names.bare.add(token)
    return names


def tree_modules() -> list[str]:
    files = [
        path
        for path in PACKAGE.rglob("*")
        if path.suffix in SOURCE_SUFFIXES and path.name != "__init__.py"
    ]
    return sorted(str(path.relative_to(PACKAGE)) for path in files)


def tree_packages() -> list[str]:
    return sorted(
        str(path.parent.relative_to(PACKAGE))
        for path in PACKAGE.rglob("__init__.py")
        if path.parent != PACKAGE
    )


def exists(path: str) -> bool:
    return (PACKAGE / path).exists() or (ROOT / path).exists()


DOC_NAMES = read_doc(DOC.read_text())


def test_every_module_is_named() -> None:
    # A top-level module's path relative to tokenmill/ is its bare name (`outputs.py`).
    named = DOC_NAMES.paths | DOC_NAMES.in_rows | DOC_NAMES.bare
    missing = [module for module in tree_modules() if module not in named]
    assert not missing, f"docs/architecture.md does not name these modules: {missing}"


def test_every_package_is_named() -> None:
    missing = [package for package in tree_packages() if package not in DOC_NAMES.folders]
    assert not missing, f"docs/architecture.md does not name these packages: {missing}"


def test_every_path_the_doc_names_exists() -> None:
    gone = sorted(path for path in DOC_NAMES.paths | DOC_NAMES.folders if not exists(path))
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"


def test_every_file_a_table_row_names_is_in_its_folder() -> None:
    # A bare name is checked against each folder of its row: one row holds one folder's files.
    rows: dict[str, set[str]] = {}
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            continue
        cells = line.split("|")[1:]
        folders = row_folders(cells[0])
        for token in filter(is_path, BACKTICKED.findall(line)):
            if "/" not in token and folders:
                rows.setdefault(token, set()).update(folders)
    stray = sorted(
        f"{name} (row of {sorted(folders)})"
        for name, folders in rows.items()
        if not any(exists(f"{folder}/{name}") for folder in folders)
    )
    assert not stray, f"docs/architecture.md names files not in their row's folder: {stray}"


def test_every_bare_file_name_exists_somewhere() -> None:
    names = {path.name for path in PACKAGE.rglob("*")} | {path.name for path in ROOT.glob("*")}
    unknown = sorted(DOC_NAMES.bare - names)
    assert not unknown, f"docs/architecture.md names files that do not exist: {unknown}"


def test_package_docstrings_that_list_their_files_list_every_subpackage() -> None:
    """A package docstring naming its own files is a table of contents: it must be whole
    (kv_transfer/'s once left out p2p/, most of its lines), and name nothing that is gone."""
    problems = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        tokens = [t for t in BACKTICKED.findall(docstring) if is_path(t)]
        own = [t for t in tokens if (folder / t).exists()]
        if not own:
            continue
        where = init.relative_to(ROOT)
        problems += [f"{where} names a missing {t}" for t in tokens if not exists_near(folder, t)]
        subpackages = [p.parent.name for p in folder.glob("*/__init__.py")]
        named = {t.rstrip("/") for t in tokens}
        problems += [f"{where} leaves out {name}/" for name in subpackages if name not in named]
    assert not problems, problems


def exists_near(folder: Path, token: str) -> bool:
    return (folder / token).exists() or exists(relative(token))


def test_the_rule_catches_an_unnamed_module_and_a_gone_file() -> None:
    """The reader itself: a bare name counts only under its row's folder."""
    names = read_doc(
        "| `core/` | the scheduler (`scheduler.py`) |\n"
        "| `engine/gone.py`, `other.py` | x |\n"
        "prose naming `thread_pool.cpp` and `docs/scale_out.md`\n"
    )
    assert "core/scheduler.py" in names.in_rows
    assert "core/block_pool.py" not in names.in_rows | names.paths
    assert "engine/other.py" in names.in_rows and "engine/gone.py" in names.paths
    assert names.folders == {"core"}
    assert names.bare == {"thread_pool.cpp"} and "docs/scale_out.md" in names.paths
