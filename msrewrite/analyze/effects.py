"""Copy branches: side work whose effect is a write into a buffer, not a value the main path reads.

A KV-cache offload copies a device buffer to host memory (`host_kv[i].copy_(temp_kv)`); nothing on
the main path consumes the copy, so there is no data edge to join on. What orders it is buffer
reuse: the copy must not start before the main path finished writing what it reads, and must be
done before the main path writes that buffer again (a write-after-read hazard) or touches the
destination. Buffers are named by attribute paths (`offload_cache.temp_kv`, subscripts dropped),
so two fields of one object do not conflict while a buffer and the object holding it do.

When nothing in the function reuses the buffers, the join goes before the function returns: the
caller (the next layer) may overwrite them. Calls we cannot see into are assumed to read, not
write, the objects they are given: that is the limit of a static, single-function view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import libcst as cst
from libcst.metadata import CodeRange

from msrewrite.analyze.branch import NoBranch, SideBranch
from msrewrite.analyze.defuse import StatementFacts, is_docstring, statement_facts

INPLACE_WRITES = frozenset({"copy_", "index_copy_", "index_put_", "scatter_", "fill_", "zero_", "add_", "mul_"})


def buffer_path(node: cst.BaseExpression) -> str | None:
    """'offload_cache.host_kv' for offload_cache.host_kv[i] (subscripts dropped), else None."""
    parts: list[str] = []
    while isinstance(node, (cst.Attribute, cst.Subscript)):
        if isinstance(node, cst.Attribute):
            parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name):
        return ".".join([node.value, *reversed(parts)])
    return None


@dataclass
class BufferUse:
    reads: set[str] = field(default_factory=set)
    writes: set[str] = field(default_factory=set)


class _Buffers(cst.CSTVisitor):
    """The buffers (longest attribute paths) a statement reads and writes."""

    def __init__(self) -> None:
        self.use = BufferUse()

    def _chain(self, node: cst.BaseExpression) -> None:
        # the indices inside a.b[i].c are ordinary reads
        while isinstance(node, (cst.Attribute, cst.Subscript)):
            if isinstance(node, cst.Subscript):
                for element in node.slice:
                    element.visit(self)
            node = node.value
        if not isinstance(node, cst.Name):
            node.visit(self)

    def visit_Call(self, node: cst.Call) -> bool:
        func = node.func
        if isinstance(func, cst.Attribute):
            path = buffer_path(func.value)
            if path:
                if func.attr.value in INPLACE_WRITES:
                    self.use.writes.add(path)
                    if func.attr.value not in ("copy_", "fill_", "zero_"):
                        self.use.reads.add(path)
                else:
                    self.use.reads.add(path)
            self._chain(func.value)
        else:
            func.visit(self)
        for arg in node.args:
            arg.value.visit(self)
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> bool:
        if isinstance(node.target, (cst.Attribute, cst.Subscript)):
            path = buffer_path(node.target)
            if path:
                self.use.writes.add(path)
            self._chain(node.target)
            return False
        return True

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        path = buffer_path(node)
        if path:
            self.use.reads.add(path)
        self._chain(node)
        return False

    def visit_Subscript(self, node: cst.Subscript) -> bool:
        path = buffer_path(node)
        if path:
            self.use.reads.add(path)
        self._chain(node)
        return False

    def visit_Name(self, node: cst.Name) -> None:
        self.use.reads.add(node.value)


def buffer_use(node: cst.CSTNode) -> BufferUse:
    visitor = _Buffers()
    node.visit(visitor)
    return visitor.use


def _overlap(a: set[str], b: set[str]) -> set[str]:
    """Paths of `a` that are, contain, or lie inside a path of `b` (self never counts)."""
    hits = set()
    for x in a:
        for y in b:
            if "self" in (x, y):
                continue
            if x == y or x.startswith(y + ".") or y.startswith(x + "."):
                hits.add(x)
    return hits


def find_copy_branch(
    func: cst.FunctionDef,
    positions: dict[cst.CSTNode, CodeRange],
    is_copy: Callable[[cst.Call], bool],
) -> SideBranch:
    body = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    facts = statement_facts(body, positions)
    uses = [buffer_use(f.node) for f in facts]

    def has_copy(f: StatementFacts) -> bool:
        found = []

        class _Copies(cst.CSTVisitor):
            def visit_Call(self, node: cst.Call) -> None:
                if is_copy(node):
                    found.append(node)

        f.node.visit(_Copies())
        return bool(found)

    side = [f for f in facts if has_copy(f)]
    if not side:
        raise NoBranch("no cache copy in this function")
    for f in side:
        if f.exits or f.self_calls:
            raise NoBranch(f"line {f.first_line}: the copy statement also does other work")
    side_idx = {f.index for f in side}
    side_reads = set().union(*(uses[f.index].reads for f in side)) - set().union(*(uses[f.index].writes for f in side))
    side_writes = set().union(*(uses[f.index].writes for f in side))
    first = min(side_idx)

    # Fork: after the last main statement (before the first copy) that writes what the copies
    # read, or defines a name they read.
    fork = 1 if body and is_docstring(body[0]) else 0
    for f in facts[:first]:
        if _overlap(uses[f.index].writes, side_reads) or (f.stores & side_reads):
            fork = max(fork, f.index + 1)
    # Moving a copy earlier must not pass a statement that changes what it reads or touches what
    # it writes: the fork goes after the last such statement.
    moved = True
    while moved:
        moved = False
        for s in side:
            for f in facts[fork : s.index]:
                if f.index in side_idx:
                    continue
                reads_changed = _overlap(uses[f.index].writes, uses[s.index].reads) or (f.stores & uses[s.index].reads)
                writes_touched = _overlap(uses[f.index].reads | uses[f.index].writes, uses[s.index].writes)
                if reads_changed or writes_touched:
                    fork, moved = f.index + 1, True
    if fork > min(side_idx) and any(facts[i].index < fork for i in side_idx if i < fork):
        late = [facts[i] for i in sorted(side_idx) if i < fork]
        for f in late:
            for g in facts[f.index + 1 : fork]:
                if g.index not in side_idx and (
                    _overlap(uses[g.index].reads | uses[g.index].writes, uses[f.index].writes)
                    or _overlap(uses[g.index].writes, uses[f.index].reads)
                ):
                    raise NoBranch(f"line {g.first_line} sits between copies that must move together")

    # Join: the first later statement that rewrites a buffer the copies read (write after read)
    # or touches one they write; else before the function returns.
    join = None
    for f in facts[max(side_idx) + 1 :]:
        if f.index in side_idx:
            continue
        if (
            _overlap(uses[f.index].writes, side_reads)
            or _overlap(uses[f.index].reads | uses[f.index].writes, side_writes)
            or f.exits
        ):
            join = f.index
            break
    if join is None:
        join = len(facts)  # falls off the end: join at the very end
    for f in facts[fork:join]:
        if f.index not in side_idx and f.exits:
            raise NoBranch(f"line {f.first_line} can return before the copy is joined")
    window = [f for f in facts[fork:join] if f.index not in side_idx]
    if not any(f.self_calls for f in window):
        raise NoBranch("no main-path work between the copy and its join: nothing to overlap")
    inputs = sorted({name for f in side for name in f.loads})
    return SideBranch(
        statements=side,
        hoists=[],
        fork=fork,
        join=join,
        inputs=inputs,
        outputs=[],
        rebound_inputs=[],
        facts=facts,
    )

