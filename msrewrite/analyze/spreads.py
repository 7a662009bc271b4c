"""Calls that pass `*sequence` or `**mapping` built in the same function, written out.

`opts = {"out": x}; torch.clamp(x, -1, 1, **opts)` writes x, but the effects table matches
arguments by keyword and position: it sees no `out=`. A mapping or sequence the function builds
itself is followed, so the call is analysed as if its keywords and positions were written out:
a dict literal, `dict(k=v, ...)`, a list or tuple literal, and later stores into it under a
literal key or index (`opts["out"] = y`). Each key or position it may hold is passed, once: a
literal constant as itself (an `inplace=True` flag reads as one), anything else as the container's
own name, whose storage (analyze/summaries.py, Storage) holds every object stored in it, so a
write through it reaches them whatever was rebound since.

Followed only when every binding of the name in the function (nested functions included) is
such a literal, the first is a top-level statement before the call's statement (no path reaches
the call with another value: a parameter, a global), and every other use of the name is a
literal-key store or read: handed to a call, aliased, updated (`opts.update(...)`, `|=`) it may
hold anything. A spread that is not followed is left in the call: the effects table then takes the
call as possibly writing what it carries (torch_effects.spread_may_writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field

import libcst as cst

from msrewrite.analyze.walk import Visitor
from msrewrite.records import record

# past this many keys or positions a spread is not written out (it may still be followed as unknown)
MAX_ITEMS = 64


@record
class _Container:
    kind: str  # "mapping" or "sequence"
    first: int | None = None  # the first top-level statement that binds it to a literal
    length: int = -1  # a sequence's length (every binding the same)
    items: dict[str | int, list[cst.BaseExpression]] = field(default_factory=dict)


def _literal(node: cst.BaseExpression) -> tuple[str, list[tuple[str | int, cst.BaseExpression]]] | None:
    """("mapping" | "sequence", its (key or position, value) pairs) for a literal container."""
    if isinstance(node, cst.Dict):
        pairs: list[tuple[str | int, cst.BaseExpression]] = []
        for element in node.elements:
            if not isinstance(element, cst.DictElement) or not isinstance(element.key, cst.SimpleString):
                return None
            key = element.key.evaluated_value
            if not isinstance(key, str):
                return None
            pairs.append((key, element.value))
        return "mapping", pairs
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "dict":
        if any(a.star or a.keyword is None for a in node.args):
            return None
        return "mapping", [(a.keyword.value, a.value) for a in node.args if a.keyword is not None]
    if isinstance(node, (cst.List, cst.Tuple)):
        if any(isinstance(e, cst.StarredElement) for e in node.elements):
            return None
        return "sequence", [(i, e.value) for i, e in enumerate(node.elements)]
    return None


def _constant(node: cst.BaseExpression) -> bool:
    if isinstance(node, (cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString)):
        return True
    if isinstance(node, cst.Name):
        return node.value in ("True", "False", "None")
    return isinstance(node, cst.UnaryOperation) and _constant(node.expression)


def _key(node: cst.BaseSlice) -> str | int | None:
    if not isinstance(node, cst.Index):
        return None
    value = node.value
    if isinstance(value, cst.SimpleString) and isinstance(value.evaluated_value, str):
        return value.evaluated_value
    if isinstance(value, cst.Integer):
        return int(value.value, 0)
    return None


class _Scan(Visitor):
    """Every binding and use of each name in a function body (nested functions included)."""

    def __init__(self, body: Sequence[cst.BaseStatement]) -> None:
        self.top = {id(stmt): i for i, stmt in enumerate(body)}
        self.containers: dict[str, _Container] = {}
        self.bad: set[str] = set()
        self.allowed: set[int] = set()  # Name nodes in a use that keeps the container followed
        self.skipped: set[int] = set()  # Name nodes that are no variables (attribute, keyword names)
        self.names: list[cst.Name] = []
        self._statement: int | None = None  # the top-level statement index of the line being visited

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self._statement = self.top.get(id(node))

    def leave_SimpleStatementLine(self, _original_node: cst.SimpleStatementLine) -> None:
        self._statement = None

    def _bind(self, name: cst.Name, value: cst.BaseExpression | None) -> None:
        found = _literal(value) if value is not None else None
        if found is None:
            self.bad.add(name.value)
            return
        kind, pairs = found
        self.allowed.add(id(name))
        box = self.containers.setdefault(name.value, _Container(kind))
        if box.kind != kind or (kind == "sequence" and box.length not in (-1, len(pairs))):
            self.bad.add(name.value)
            return
        if kind == "sequence":
            box.length = len(pairs)
        for key, item in pairs:
            box.items.setdefault(key, []).append(item)
        if self._statement is not None:
            box.first = self._statement if box.first is None else min(box.first, self._statement)

    def _store_item(self, target: cst.Subscript, value: cst.BaseExpression) -> None:
        name = target.value
        assert isinstance(name, cst.Name)
        key = _key(target.slice[0].slice) if len(target.slice) == 1 else None
        if key is None:
            self.bad.add(name.value)
            return
        self.allowed.add(id(name))
        self.containers.setdefault(name.value, _Container("mapping" if isinstance(key, str) else "sequence"))
        self.containers[name.value].items.setdefault(key, []).append(value)  # checked in followed()

    def _target(self, target: cst.BaseExpression, value: cst.BaseExpression | None) -> None:
        if isinstance(target, cst.Name):
            self._bind(target, value)
        elif isinstance(target, cst.Subscript) and isinstance(target.value, cst.Name) and value is not None:
            self._store_item(target, value)

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            self._target(target.target, node.value if len(node.targets) == 1 else None)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._target(node.target, node.value)

    def visit_Subscript(self, node: cst.Subscript) -> None:
        # `opts["k"]` read: the container stays as it is (a store target was allowed above)
        if isinstance(node.value, cst.Name) and len(node.slice) == 1 and _key(node.slice[0].slice) is not None:
            self.allowed.add(id(node.value))

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self.skipped.add(id(node.keyword))
        if node.star and isinstance(node.value, cst.Name):
            self.allowed.add(id(node.value))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.skipped.add(id(node.attr))

    def visit_Name(self, node: cst.Name) -> None:
        self.names.append(node)

    def followed(self) -> dict[str, _Container]:
        bad = set(self.bad)
        for name in self.names:  # any other use (a rebinding, handed on, updated) may change it
            if id(name) not in self.allowed and id(name) not in self.skipped:
                bad.add(name.value)
        return {
            n: box
            for n, box in self.containers.items()
            if n not in bad and box.first is not None and len(box.items) <= MAX_ITEMS and _consistent(box)
        }


def _consistent(box: _Container) -> bool:
    """Every key a string (a mapping), or every position inside the sequence's one length."""
    if box.kind == "mapping":
        return all(isinstance(k, str) for k in box.items)
    return all(isinstance(k, int) and 0 <= k < box.length for k in box.items)


def _written_out(
    spread: cst.Arg, containers: dict[str, _Container], at: int
) -> tuple[list[cst.Arg], list[cst.Arg]] | None:
    """(positional args, keyword args) that `*value` / `**value` stands for, or None."""
    value = spread.value
    literal = _literal(value)
    holder: cst.Name | None = None
    if literal is not None:
        kind, pairs = literal
        items = {key: [item] for key, item in pairs}
    elif isinstance(value, cst.Name) and value.value in containers and (containers[value.value].first or 0) < at:
        box = containers[value.value]
        kind, items, holder = box.kind, box.items, value
    else:
        return None
    if (spread.star == "**") != (kind == "mapping"):
        return None

    def one(values: list[cst.BaseExpression]) -> cst.BaseExpression:
        if holder is None and len(values) == 1:
            return values[0]  # written at the call itself
        codes = {cst.Module(body=[]).code_for_node(v) for v in values}
        if len(codes) == 1 and _constant(values[0]):
            return values[0]
        assert holder is not None  # an inline literal has one value per key
        return cst.Name(holder.value)  # it holds every object stored in it

    if kind == "sequence":
        return [cst.Arg(value=one(items[i])) for i in sorted(k for k in items if isinstance(k, int))], []
    return [], [
        cst.Arg(value=one(items[k]), keyword=cst.Name(k)) for k in items if isinstance(k, str) and k.isidentifier()
    ]


def spread_expansions(body: Sequence[cst.BaseStatement]) -> dict[int, tuple[cst.Arg, ...]]:
    """id(call) -> the call's arguments with each followed spread written out (positional ones
    first, in order, then keywords), for every call in `body` that passes one."""
    spreading: list[tuple[int, cst.Call]] = []  # (top-level statement, call)

    class _Calls(Visitor):
        def __init__(self, at: int) -> None:
            self.at = at

        def visit_Call(self, call: cst.Call) -> None:
            if any(a.star for a in call.args):
                spreading.append((self.at, call))

    for at, stmt in enumerate(body):
        stmt.visit(_Calls(at))
    if not spreading:
        return {}  # the common case: nothing to follow, no scan of the names
    scan = _Scan(body)
    for stmt in body:
        stmt.visit(scan)
    containers = scan.followed()
    out: dict[int, tuple[cst.Arg, ...]] = {}
    for at, call in spreading:
        positional: list[cst.Arg] = []
        keywords: list[cst.Arg] = []
        changed = False
        for arg in call.args:
            written = _written_out(arg, containers, at) if arg.star else None
            if written is not None:
                positional += written[0]
                keywords += written[1]
                changed = True
            elif arg.keyword is not None or arg.star == "**":
                keywords.append(arg)
            else:
                positional.append(arg)
        if changed:
            out[id(call)] = (*positional, *keywords)
    return out
