"""Static def-use facts for the top-level statements of one function (no import, no execution).

Each statement (a compound statement counts as one unit) gets the names it reads, the names it
binds, the names whose objects it mutates in place, and the `self.<attr>` submodules it calls.
That is enough to decide whether a group of statements can move: dataflow by name, plus
in-place writes, which are what make moving tensor code unsafe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import CodeRange


@dataclass
class StatementFacts:
    index: int
    node: cst.BaseStatement
    first_line: int
    last_line: int
    loads: set[str] = field(default_factory=set)
    stores: set[str] = field(default_factory=set)
    mutates: set[str] = field(default_factory=set)
    self_calls: list[str] = field(default_factory=list)  # dotted callee after "self.", e.g. "shared_expert.down_proj"
    has_call: bool = False
    exits: bool = False  # contains return / yield: leaving the function early

    def calls_self(self, names: set[str]) -> bool:
        return any(callee.split(".")[0] in names for callee in self.self_calls)


def dotted_name(node: cst.BaseExpression) -> str | None:
    """'self.shared_expert.down_proj' for an attribute chain of names, else None."""
    parts: list[str] = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name):
        parts.append(node.value)
        return ".".join(reversed(parts))
    return None


def self_callee(func: cst.BaseExpression) -> str | None:
    """'experts' for self.experts[i](...), 'shared_expert.down_proj' for self.shared_expert.down_proj(...)."""
    parts: list[str] = []
    node = func
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        if isinstance(node, cst.Attribute):
            parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name) and node.value == "self" and parts:
        return ".".join(reversed(parts))
    return None


def _root_name(node: cst.BaseExpression) -> str | None:
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None


# torch.distributed calls that write into their first (tensor) argument
WRITES_FIRST_ARG = frozenset({"recv", "irecv", "all_reduce", "broadcast", "reduce", "all_to_all_single"})


def _is_inplace_method(name: str) -> bool:
    # torch's convention: add_, copy_, mul_ ... mutate their receiver; dunder and private names do not count.
    return name.endswith("_") and not name.startswith("_") and name != "_"


class _Collector(cst.CSTVisitor):
    def __init__(self, facts: StatementFacts) -> None:
        self.facts = facts

    # names --------------------------------------------------------------------------
    def visit_Name(self, node: cst.Name) -> None:
        self.facts.loads.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)  # `attr` is a field name, not a variable
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)  # skip the keyword's name
        return False

    def _store_target(self, target: cst.BaseExpression) -> None:
        if isinstance(target, cst.Name):
            self.facts.stores.add(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self._store_target(element.value)
        elif isinstance(target, cst.StarredElement):
            self._store_target(target.value)
        elif isinstance(target, (cst.Attribute, cst.Subscript)):
            # x[i] = v or x.attr = v writes into the object x names.
            root = _root_name(target)
            if root is not None:
                self.facts.mutates.add(root)
            target.visit(self)

    def visit_Assign(self, node: cst.Assign) -> bool:
        for target in node.targets:
            self._store_target(target.target)
        node.value.visit(self)
        return False

    def visit_AnnAssign(self, node: cst.AnnAssign) -> bool:
        self._store_target(node.target)
        if node.value is not None:
            node.value.visit(self)
        return False

    def visit_AugAssign(self, node: cst.AugAssign) -> bool:
        # `t += x` on a tensor writes into t's storage, which other names may share.
        root = _root_name(node.target)
        if root is not None:
            self.facts.mutates.add(root)
            self.facts.loads.add(root)
            if isinstance(node.target, cst.Name):
                self.facts.stores.add(root)
        node.value.visit(self)
        return False

    def visit_For(self, node: cst.For) -> None:
        self._store_target(node.target)

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._store_target(node.asname.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> bool:
        self._store_target(node.target)
        node.value.visit(self)
        return False

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self._store_target(node.target)

    def visit_Del(self, node: cst.Del) -> bool:
        root = _root_name(node.target)
        if root is not None:
            self.facts.stores.add(root)
        return False

    # calls and exits ------------------------------------------------------------------
    def visit_Call(self, node: cst.Call) -> None:
        self.facts.has_call = True
        callee = dotted_name(node.func) or ""
        module, _, name = callee.rpartition(".")
        if module in ("dist", "torch.distributed") and name in WRITES_FIRST_ARG and node.args:
            target = node.args[0].value  # recv/irecv/all_reduce... fill their tensor argument
            if isinstance(target, cst.Name):
                self.facts.stores.add(target.value)
                self.facts.mutates.add(target.value)
        callee = self_callee(node.func)
        if callee:
            self.facts.self_calls.append(callee)
        if isinstance(node.func, cst.Attribute) and _is_inplace_method(node.func.attr.value):
            root = _root_name(node.func.value)
            if root is not None and root != "self":
                self.facts.mutates.add(root)

    def visit_Return(self, node: cst.Return) -> None:
        self.facts.exits = True

    def visit_Yield(self, node: cst.Yield) -> None:
        self.facts.exits = True

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.facts.stores.add(node.name.value)
        return False  # a nested def's body runs later, not here

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False


_recent_facts: list[tuple[list, object, list[StatementFacts]]] = []  # suggest asks the same body many times


def statement_facts(
    body: list[cst.BaseStatement], positions: dict[cst.CSTNode, CodeRange]
) -> list[StatementFacts]:
    for seen, seen_positions, facts in _recent_facts:  # nodes are immutable: same statements, same facts
        if seen_positions is positions and len(seen) == len(body) and all(a is b for a, b in zip(seen, body)):
            return [
                dataclasses.replace(
                    f, loads=set(f.loads), stores=set(f.stores), mutates=set(f.mutates), self_calls=list(f.self_calls)
                )
                for f in facts
            ]
    facts = _statement_facts(body, positions)
    _recent_facts[:] = [(list(body), positions, facts), *_recent_facts[:3]]
    return statement_facts(body, positions)  # a copy: callers own what they get


def _statement_facts(
    body: list[cst.BaseStatement], positions: dict[cst.CSTNode, CodeRange]
) -> list[StatementFacts]:
    facts = []
    for index, stmt in enumerate(body):
        where = positions[stmt]
        item = StatementFacts(index=index, node=stmt, first_line=where.start.line, last_line=where.end.line)
        stmt.visit(_Collector(item))
        item.loads.discard("self")
        facts.append(item)
    return facts


def is_docstring(stmt: cst.BaseStatement) -> bool:
    """A bare string statement (a function's docstring when it comes first)."""
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def node_facts(node: cst.CSTNode) -> StatementFacts:
    """Loads, stores and mutations of any node, without source positions."""
    item = StatementFacts(index=-1, node=node, first_line=0, last_line=0)  # type: ignore[arg-type]
    node.visit(_Collector(item))
    item.loads.discard("self")
    return item


def expression_loads(node: cst.CSTNode) -> set[str]:
    item = StatementFacts(index=-1, node=node, first_line=0, last_line=0)  # type: ignore[arg-type]
    node.visit(_Collector(item))
    item.loads.discard("self")
    return item.loads


_recent_names: list[tuple[cst.CSTNode, frozenset[str]]] = []  # suggest asks the same function many times


def function_names(node: cst.CSTNode) -> set[str]:
    """Every name a node mentions (a function's parameters included): new names must avoid them."""
    for seen, names in _recent_names:  # nodes are immutable: the same node mentions the same names
        if seen is node:
            return set(names)
    names = _function_names(node)
    _recent_names[:] = [(node, frozenset(names)), *_recent_names[:3]]
    return names


def _function_names(node: cst.CSTNode) -> set[str]:
    names: set[str] = set()

    class _Names(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            names.add(n.value)

    node.visit(_Names())
    return names
