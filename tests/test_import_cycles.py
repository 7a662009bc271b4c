"""No import cycles in msrewrite/, read statically with `ast` (nothing is imported).

What counts as an edge A -> B: a statement of A that imports B, where B is a module of msrewrite
(`from P import name` is an edge to P.name when that is a module, else to P). An import of a
module does not count as an edge to its parent packages, whose `__init__` Python runs first:
otherwise every package that re-exports its submodules would be a cycle. Imports under
`if TYPE_CHECKING:` never run and do not count.

Two graphs are checked:

- Module-level imports (those that run when A is imported: at top level, or inside a top-level
  `if`/`try`/`with`/class body): no cycle at all. Such a cycle is the kind that breaks at import
  time, depending on which module is imported first.
- Every import, function-level (lazy) ones included: a lazy import keeps a cycle from breaking
  at import time, but the two modules still depend on each other: no cycle either (the last
  ones went with #15's case objects and emitter split).

The rule is recursive over folders (msrewrite/cases/ and msrewrite/codemods/ are packages like the
others). The case registry (msrewrite/cases/__init__.py) imports its case modules by name with
importlib, which this static check does not see: it imports no case machinery itself, so that the
emitter's lookup of a case's words closes no cycle.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "msrewrite"


def _modules() -> dict[str, Path]:
    found = {}
    for folder, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = Path(folder) / name
                parts = list(path.relative_to(ROOT).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(body: list[ast.stmt], lazy: bool):
    """The import statements that run with `body`; with `lazy`, those in function bodies too."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _imports(node.body, lazy)
            yield from _imports(node.orelse, lazy)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _imports(block, lazy)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.ClassDef)):
            yield from _imports(node.body, lazy)
        elif lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(node.body, lazy)
        elif lazy and isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            yield from _imports(node.body + node.orelse, lazy)
        elif lazy and isinstance(node, ast.Match):
            for case in node.cases:
                yield from _imports(case.body, lazy)


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = importer.split(".") if is_package else importer.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def import_graph(lazy: bool) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {
            target
            for node in _imports(tree.body, lazy)
            for target in _targets(node, name, is_package, modules)
            if target in modules and target != name
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _describe(found: list[list[str]]) -> str:
    return "\n".join("  " + " <-> ".join(component) for component in found)


def test_cycle_finder_sees_a_cycle_and_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_reads_lazy_and_type_checking_imports_as_documented(tmp_path, monkeypatch):
    package = tmp_path / "msrewrite"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import one\n")
    (package / "sub" / "one.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from msrewrite.sub.two import X\n"
        "def f():\n    from msrewrite.sub import two\n"
    )
    (package / "sub" / "two.py").write_text("from .one import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    eager, lazy = import_graph(lazy=False), import_graph(lazy=True)
    assert eager["msrewrite.sub"] == {"msrewrite.sub.one"}  # a submodule, not the package itself
    assert eager["msrewrite.sub.one"] == set()  # TYPE_CHECKING and function-level imports: no edge
    assert eager["msrewrite.sub.two"] == {"msrewrite.sub.one"}  # relative import resolved
    assert lazy["msrewrite.sub.one"] == {"msrewrite.sub.two"}
    assert cycles(eager) == [] and cycles(lazy) == [["msrewrite.sub.one", "msrewrite.sub.two"]]


def test_no_module_level_import_cycle():
    found = cycles(import_graph(lazy=False))
    assert not found, "module-level import cycles in msrewrite/:\n" + _describe(found)


def test_no_import_cycle_through_lazy_imports_either():
    """Imports inside functions count too: the last known cycles went with #15's case objects and
    emitter split, and none may come back."""
    found = cycles(import_graph(lazy=True))
    assert not found, "import cycles in msrewrite/ (lazy imports included):\n" + _describe(found)


def test_tests_import_helpers_not_conftest():
    """Shared test helpers live in tests/helpers.py; conftest.py holds fixtures only."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "conftest":
                offenders.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(alias.name == "conftest" for alias in node.names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, "import from helpers, not conftest: " + ", ".join(offenders)
