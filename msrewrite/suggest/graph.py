"""Op DAG analysis: independent branches (Nimble-style reachability), grouped back to statements.

For a function `Class.forward` of the model file, its scope is the ops run while one instance of
that class executes; each op maps to the statement of that forward its frame chain passes
through. At every join op with two producers a and b, `anc(a) - anc(b)` and `anc(b) - anc(a)`
are independent by construction (a path between them would put its source in both ancestor
sets). Each such pair, lifted to statements, is a branch pair; the planner checks whether the
source allows the move.
"""

from __future__ import annotations

import inspect
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING

from msrewrite.analyze.digraph import DiGraph, transitive_reduction
from msrewrite.analyze.stmtgraph import FunctionInfo, Statement
from msrewrite.records import record

if TYPE_CHECKING:
    from msrewrite.suggest.trace import OpRecord, Trace


@record
class Scope:
    qualname: str  # "DeepseekV3MoE.forward"
    path: str  # module path of the instance analyzed ("" for the root)
    ops: list[OpRecord]
    stmt_of: dict[int, int] = field(default_factory=dict)  # op index -> statement index


@record
class BranchPair:
    """Two independent op sets meeting at a join op."""

    join_op: int
    a_ops: frozenset[int]
    b_ops: frozenset[int]


def op_dag(ops: list[OpRecord]) -> DiGraph:
    dag = DiGraph()
    present = {op.index for op in ops}
    for op in ops:
        dag.add_node(op.index)
        dag.add_edges_from((d, op.index) for d in op.deps if d in present)
    return dag


def forward_qualname(module) -> tuple[str, str] | None:
    """(qualname, file) of the forward a module instance runs."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if code is None:
        return None
    return code.co_qualname, code.co_filename


def scopes(trace: Trace, functions: dict[str, FunctionInfo]) -> list[Scope]:
    """One scope per forward of the model file, the first instance that ran it."""
    model_file = str(trace.model_file.resolve())
    found: dict[str, Scope] = {}
    for path, module in trace.modules.items():
        where = forward_qualname(module)
        if where is None or str(Path(where[1]).resolve()) != model_file:
            continue
        qualname = where[0]
        if qualname in found or qualname not in functions:
            continue
        ops = [op for op in trace.ops if path in op.module_stack]
        if not ops:
            continue
        info = functions[qualname]
        scope = Scope(qualname=qualname, path=path, ops=ops)
        for op in ops:
            line = op.line_in(qualname)
            stmt = info.statement_at(line) if line is not None else None
            if stmt is not None:
                scope.stmt_of[op.index] = stmt.index
        scope.ops = [op for op in ops if op.index in scope.stmt_of]
        if scope.ops:
            found[qualname] = scope
    return list(found.values())


def branch_pairs(scope: Scope, weight: dict[int, float], limit: int = 400) -> list[BranchPair]:
    """Exclusive-ancestor pairs at join ops, heaviest first (the lighter side's weight)."""
    order = [op.index for op in scope.ops]
    position = {index: i for i, index in enumerate(order)}
    ancestors: dict[int, int] = {}  # op -> bitmask of ancestors (by position), itself included
    for op in scope.ops:
        mask = 1 << position[op.index]
        for dep in op.deps:
            if dep in position:
                mask |= ancestors[dep]
        ancestors[op.index] = mask
    pairs: dict[tuple[frozenset[int], frozenset[int]], BranchPair] = {}
    for op in scope.ops:
        preds = sorted(d for d in op.deps if d in position)
        for i, a in enumerate(preds):
            for b in preds[i + 1 :]:
                only_a = ancestors[a] & ~ancestors[b]
                only_b = ancestors[b] & ~ancestors[a]
                if not only_a or not only_b:
                    continue
                a_ops = frozenset(order[p] for p in _bits(only_a))
                b_ops = frozenset(order[p] for p in _bits(only_b))
                key = (a_ops, b_ops) if min(a_ops) < min(b_ops) else (b_ops, a_ops)
                if key not in pairs:
                    pairs[key] = BranchPair(join_op=op.index, a_ops=key[0], b_ops=key[1])
    ranked = sorted(
        pairs.values(),
        key=lambda p: -min(sum(weight.get(o, 0.0) for o in p.a_ops), sum(weight.get(o, 0.0) for o in p.b_ops)),
    )
    return ranked[:limit]


def _bits(mask: int):
    position = 0
    while mask:
        if mask & 1:
            yield position
        mask >>= 1
        position += 1


def statements_of(scope: Scope, ops: frozenset[int]) -> set[int]:
    return {scope.stmt_of[o] for o in ops if o in scope.stmt_of}


def submodule_of_ops(scope: Scope, ops: frozenset[int], by_index: dict[int, OpRecord]) -> set[str]:
    """First module path component below the scope for each op (`shared_experts`, `self_attn.1`)."""
    prefix = f"{scope.path}." if scope.path else ""
    names = set()
    for o in ops:
        op = by_index[o]
        inner = [p for p in op.module_stack if p.startswith(prefix) and p != scope.path]
        names.add(inner[0][len(prefix) :] if inner else "")
    return names


def call_for_submodule(stmt: Statement, submodule: str):
    """The `self.<sub>(...)` call of a statement that runs module path component `submodule`."""
    wanted = (
        submodule.replace(".", "[", 1) + "]" if "." in submodule and submodule.split(".")[1].isdigit() else submodule
    )
    for call in stmt.calls:
        if call.callee == wanted or call.callee == submodule:
            return call
    return None


# Synchronization ----------------------------------------------------------------------------------
ENTRY = "entry"  # the main-stream work before the scope (its inputs were produced there)


def reduced_dag(ops: list[OpRecord]) -> tuple[DiGraph, dict]:
    """Transitive reduction of a scope's op DAG, with ENTRY feeding ops that read scope inputs.

    Returns (reduced DAG, position of each node in issue order; ENTRY is -1).
    """
    dag = op_dag(ops)
    present = set(dag.nodes)
    dag.add_node(ENTRY)
    for op in ops:
        if op.deps - present:
            dag.add_edge(ENTRY, op.index)
    reduced = transitive_reduction(dag)
    position: dict[int | str, int] = {op.index: i for i, op in enumerate(ops)}
    position[ENTRY] = -1
    return reduced, position


def sync_points(reduced: DiGraph, position: dict, side: set) -> dict[str, int]:
    """Fewest fork and join synchronizations for one side stream running `side` in issue order.

    Crossing edges of the transitive reduction are the dependences a sync must cover. One event
    covers every earlier op of its stream, so walking the waiting stream in order, a new sync is
    needed only when an op waits for a later op than the last sync covered (greedy, which keeps
    each wait as late as its dependences allow, so overlap is not given up to save a sync).
    """
    side = {n for n in side if n in reduced}
    fork_edges = [(u, v) for u, v in reduced.edges if u not in side and v in side]
    join_edges = [(u, v) for u, v in reduced.edges if u in side and v not in side]

    def count(edges) -> int:
        need: dict = {}
        for u, v in edges:
            need[v] = max(need.get(v, -2), position[u])
        syncs, covered = 0, -2
        for v in sorted(need, key=position.__getitem__):  # every node has a position
            if need[v] > covered:
                syncs, covered = syncs + 1, need[v]
        return syncs

    return {
        "fork": count(fork_edges),
        "join": count(join_edges),
        "fork_edges": len(fork_edges),
        "join_edges": len(join_edges),
    }
