"""Which `def` Python keeps when a class or module body binds a name more than once.

A class body runs top to bottom: a second `def forward` (or `forward = ...`, an import of that
name, `del forward`) replaces the first, which is dead code. Editing or summarising the dead one
is wrong twice over: the edit does nothing at run time, and the analysis reads code that never
runs in place of the code that does. Every place that looks a function up by name goes through
here so it sees the definition that runs.

Later means later in the same block, or after the enclosing `if`/`try`/`with` in an outer block:
the two arms of an `if`/`else` are alternatives, not one after the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst


def _target_names(node: cst.BaseExpression) -> set[str]:
    if isinstance(node, cst.Name):
        return {node.value}
    if isinstance(node, (cst.Tuple, cst.List)):
        return set().union(*(_target_names(e.value) for e in node.elements))
    if isinstance(node, cst.StarredElement):
        return _target_names(node.value)
    return set()


def _small_binds(small: cst.BaseSmallStatement) -> set[str]:
    if isinstance(small, cst.Assign):
        return set().union(*(_target_names(t.target) for t in small.targets))
    if isinstance(small, cst.AnnAssign):
        return _target_names(small.target) if small.value is not None else set()
    if isinstance(small, cst.AugAssign):
        return _target_names(small.target)
    if isinstance(small, cst.Del):
        return _target_names(small.target)
    if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
        bound = set()
        for alias in small.names:
            if alias.asname is not None:
                bound |= _target_names(alias.asname.name)  # type: ignore[arg-type]
            else:
                bound.add(cst.Module(body=[]).code_for_node(alias.name).split(".")[0])
        return bound
    return set()


def _blocks(stmt: cst.BaseCompoundStatement) -> list[Sequence[cst.BaseStatement]]:
    """The statement lists of a compound statement that run in the enclosing scope (not a def's
    or a class's own body)."""
    out: list[Sequence[cst.BaseStatement]] = []
    pending: list[cst.CSTNode | None] = [stmt]
    while pending:
        node = pending.pop()
        if node is None:
            continue
        body = getattr(node, "body", None)
        if isinstance(body, cst.IndentedBlock):
            out.append(body.body)
        elif isinstance(body, cst.SimpleStatementSuite):
            out.append([cst.SimpleStatementLine(body=body.body)])
        orelse = getattr(node, "orelse", None)
        pending.append(orelse if isinstance(orelse, (cst.If, cst.Else)) else None)
        pending += list(getattr(node, "handlers", ()) or ())
        pending.append(getattr(node, "finalbody", None))
        pending += list(getattr(node, "cases", ()) or ())
    return out


def binds(stmt: cst.BaseStatement) -> set[str]:
    """The names a statement binds in the scope it runs in (inside its `if`/`try`/... blocks too)."""
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return {stmt.name.value}
    if isinstance(stmt, cst.SimpleStatementLine):
        return set().union(*(_small_binds(s) for s in stmt.body))
    bound: set[str] = set()
    if isinstance(stmt, (cst.For, cst.With)):
        targets = [stmt.target] if isinstance(stmt, cst.For) else [i.asname.name for i in stmt.items if i.asname]
        for target in targets:
            bound |= _target_names(target)  # type: ignore[arg-type]
    for block in _blocks(stmt):  # type: ignore[arg-type]
        for inner in block:
            bound |= binds(inner)
    return bound


def shadowed_defs(body: Sequence[cst.BaseStatement]) -> set[int]:
    """ids of the `def`s in this scope (blocks of `if`/`try`/... included) whose name a later
    statement binds again: Python does not keep them."""
    dead: set[int] = set()

    def walk(block: Sequence[cst.BaseStatement], later_outside: frozenset[str]) -> None:
        later = set(later_outside)
        after: list[frozenset[str]] = []
        for stmt in reversed(block):  # each statement's "bound after it", last first
            after.append(frozenset(later))
            later |= binds(stmt)
        for stmt, bound_after in zip(block, reversed(after), strict=True):
            if isinstance(stmt, cst.FunctionDef):
                if stmt.name.value in bound_after:
                    dead.add(id(stmt))
            elif isinstance(stmt, cst.BaseCompoundStatement) and not isinstance(stmt, cst.ClassDef):
                for inner in _blocks(stmt):
                    walk(inner, bound_after)

    walk(body, frozenset())
    return dead


def kept_method(cls: cst.ClassDef | None, name: str) -> cst.FunctionDef | None:
    """The `def name` directly in the class body that Python keeps: the last one, and None when
    a later statement binds the name to something else."""
    if cls is None or not isinstance(cls.body, cst.IndentedBlock):
        return None
    defs = [s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name]
    if not defs or id(defs[-1]) in shadowed_defs(cls.body.body):
        return None
    return defs[-1]


def last_def(body: Sequence[cst.CSTNode], name: str) -> cst.FunctionDef | None:
    """The last `def name` directly in `body` (the one that runs when two share a name), even if
    something else rebinds the name later: for readers that fall back to "unknown" on their own."""
    defs = [s for s in body if isinstance(s, cst.FunctionDef) and s.name.value == name]
    return defs[-1] if defs else None
