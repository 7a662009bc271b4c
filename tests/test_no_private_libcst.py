"""No private libcst API in msrewrite/ (#15): no attribute libcst defines with a leading
underscore (`node._visit_and_replace_children`, `provider._computed`), no import from a private
libcst module (`libcst._position`) or of a name a public package does not export (its __all__:
`libcst.metadata.position_provider.PositionProvidingCodegenState`), and no private module's name
in a string, except the allow-listed ones below, each with its reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import libcst

from helpers import ROOT

# (file, what): why it stays (none today; walk.py's TRIVIA named libcst._nodes.* until session 6)
ALLOWED: dict[tuple[str, str], str] = {}

_DEFINED = re.compile(
    r"^\s*(?:async\s+)?(?:def|class)\s+(_[a-z]\w*)"  # a private function, method or class
    r"|\bself\.(_[a-z]\w*)\s*(?::[^=\n]*)?=(?!=)"  # a private instance attribute
    r"|^\s*(_[a-z]\w*)\s*(?::[^=\n]*)?=(?!=)",  # a private module or class attribute
    re.MULTILINE,
)


def libcst_private_names() -> set[str]:
    """Every `_name` libcst's own source defines: functions, methods, classes, attributes."""
    names: set[str] = set()
    for path in Path(libcst.__file__).parent.rglob("*.py"):
        if "tests" not in path.parts:
            names.update(
                n for match in _DEFINED.finditer(path.read_text(encoding="utf-8")) for n in match.groups() if n
            )
    return names


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """The names msrewrite defines itself (a `self._cache` of its own is not libcst's)."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
    return own


def private_uses(trees: dict[str, ast.Module], private: set[str]) -> list[tuple[str, int, str]]:
    """(file, line, what) for each private libcst name the sources use."""
    own = _own_names(trees)
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Attribute) and node.attr in private:
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if not (on_self and node.attr in own):
                    what = node.attr
            elif isinstance(node, ast.ImportFrom) and node.module and _private_module(node.module):
                what = node.module
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "libcst":
                what = next((f"{node.module}.{a.name}" for a in node.names if not _exported(node.module, a.name)), None)
            elif isinstance(node, ast.Import):
                what = next((a.name for a in node.names if _private_module(a.name)), None)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _private_module(node.value):
                what = node.value
            if what is not None:
                found.append((name, node.lineno, what))
    return found


def _exported(module: str, name: str) -> bool:
    """A name a public libcst package exports (its __all__): not one of a module inside it."""
    import importlib

    package = importlib.import_module(module)
    return hasattr(package, "__path__") and name in getattr(package, "__all__", ())


def _private_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "libcst" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _trees(folder: Path) -> dict[str, ast.Module]:
    return {
        path.relative_to(ROOT).as_posix(): ast.parse(path.read_text(encoding="utf-8"))
        for path in sorted(folder.rglob("*.py"))
    }


def test_msrewrite_uses_no_private_libcst_api():
    uses = private_uses(_trees(ROOT / "msrewrite"), libcst_private_names())
    unexplained = [use for use in uses if (use[0], use[2]) not in ALLOWED]
    assert not unexplained, unexplained
    # the allow-list holds only what is still there
    assert {(f, what) for f, _line, what in uses} == set(ALLOWED)


def test_the_check_finds_private_libcst_api():
    """The check fails on what #15 found (walk.py's, dataflow.py's) and passes msrewrite's own
    private names used on self."""
    source = """
import libcst._position_provider
from libcst._nodes.base import CSTNode
from libcst.metadata.position_provider import PositionProvidingCodegenState

class Mine:
    def __init__(self):
        self._cache = {}

    def read(self, node, provider, recorder):
        node._visit_and_replace_children(recorder)
        self._cache.clear()
        return provider._computed
"""
    uses = private_uses({"snippet.py": ast.parse(source)}, libcst_private_names())
    assert sorted(what for _f, _line, what in uses) == [
        "_computed",
        "_visit_and_replace_children",
        "libcst._nodes.base",
        "libcst._position_provider",
        "libcst.metadata.position_provider.PositionProvidingCodegenState",
    ]
