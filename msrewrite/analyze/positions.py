"""Source lines for the statements of one function, without a whole-file position pass.

libcst's PositionProvider re-renders the whole module to find line numbers, which costs more
than parsing it. The analysis only needs lines inside the function it edits, so it renders that
function alone and shifts the result by where `ast` (cheap) says the function starts.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from functools import lru_cache

import libcst as cst
from libcst.metadata import CodePosition, CodeRange, MetadataWrapper, PositionProvider


def _functions(text: str):
    """(qualified name, ast node) of every def, classes nested, in source order."""

    def walk(body, prefix: str):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.If, ast.Try)):
                yield from walk(node.body, prefix)

    tree = _tree(text)
    if tree is not None:
        yield from walk(tree.body, "")


@lru_cache(maxsize=4)
def _tree(text: str) -> ast.Module | None:
    """One ast parse per source text, shared by every lookup (read only)."""
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def parsed_tree(text: str) -> ast.Module | None:
    """The file's `ast` (cached, shared, read only), None when it does not parse."""
    return _tree(text)


def ast_nodes(node: ast.AST) -> list[ast.AST]:
    """`list(ast.walk(node))`, in the same (breadth-first) order, in half the time (no generator
    per node)."""
    found = [node]
    for current in found:  # grows as it goes: a queue
        for name in current._fields:
            value = getattr(current, name, None)
            if isinstance(value, ast.AST):
                found.append(value)
            elif isinstance(value, list):
                found.extend(item for item in value if isinstance(item, ast.AST))
    return found


@lru_cache(maxsize=8)
def def_lines(text: str) -> dict[str, int]:
    """Qualified function name ("Class.method", nested classes dotted) -> line of its `def`: of the
    last one when a name is defined twice, the one Python keeps (analyze/definitions.py)."""
    return {name: node.lineno for name, node in _functions(text)}


def function_positions(func: cst.FunctionDef, def_line: int) -> dict[cst.CSTNode, CodeRange]:
    """Positions of every node inside `func`, in the file's line numbers."""
    bare = func.with_changes(leading_lines=(), decorators=(), lines_after_decorators=())
    raw = _positions(cst.Module(body=[bare]))
    shift = def_line - 1
    return {
        node: CodeRange(
            CodePosition(r.start.line + shift, r.start.column), CodePosition(r.end.line + shift, r.end.column)
        )
        for node, r in raw.items()
    }


def _positions(module: cst.Module) -> Mapping[cst.CSTNode, CodeRange]:
    """PositionProvider's ranges: one rendering of the module (PositionProvider is no batched
    provider, so the wrapper does not walk the module, and it is told not to copy it: the ranges
    are those of the very nodes)."""
    return MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)


_recent: list[tuple[cst.FunctionDef, int, dict]] = []  # analysis and emitter ask for the same function


def positions_for(module: cst.Module, qualified: str, func: cst.FunctionDef, text: str | None = None):
    """Positions for `func` (named `qualified`) of `module`, whose source is `text` when known."""
    line = def_lines(text if text is not None else module.code).get(qualified)
    if line is None:  # ast and libcst disagree on the name: fall back to the whole-file pass
        return MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    for node, at, positions in _recent:
        if node is func and at == line:
            return positions
    positions = function_positions(func, line)
    _recent[:] = [(func, line, positions), *_recent[:3]]
    return positions


# what cannot hold a call: names, constants, contexts and operators, and the plain values some
# node lists hold (Global.names, a dict display's None key)
_NO_CALLS = frozenset(
    {ast.Name, ast.Constant, str, type(None)}
    | {c for c in vars(ast).values() if isinstance(c, type) and issubclass(c, ast.AST) and not c._fields}
)


def ast_calls(node: ast.AST) -> list[ast.Call]:
    """The ast.Call nodes under `node` (itself included): those of ast.walk, in no set order."""
    calls: list[ast.Call] = []
    todo: list = [node]
    while todo:
        current = todo.pop()
        kind = type(current)
        if kind in _NO_CALLS:
            continue
        if kind is ast.Call:
            calls.append(current)
        for name in current._fields:
            value = getattr(current, name, None)
            if type(value) is list:
                todo.extend(value)
            elif isinstance(value, ast.AST):
                todo.append(value)
    return calls


@lru_cache(maxsize=8)
def self_calls(text: str) -> dict[str, frozenset[str]]:
    """Qualified function name -> the dotted `self.<...>(` callees in it (a cheap `ast` pre-filter)."""

    def callee(func: ast.expr) -> str | None:
        parts = []
        while isinstance(func, (ast.Attribute, ast.Subscript)):
            if isinstance(func, ast.Attribute):
                parts.append(func.attr)
            func = func.value
        if isinstance(func, ast.Name) and func.id == "self" and parts:
            return ".".join(reversed(parts))
        return None

    found: dict[str, frozenset[str]] = {}
    for name, node in _functions(text):
        names = {callee(call.func) for call in ast_calls(node)}
        found.setdefault(name, frozenset(n for n in names if n))
    return found
