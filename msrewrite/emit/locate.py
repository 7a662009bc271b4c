"""Where a plan's lines go: its function, and the statements of that function's body at which the
fork, the side statements and the join sit (checked against the plan, which names them by line
and text: a plan that no longer matches the file is stale and refused)."""

from __future__ import annotations

from dataclasses import field

import libcst as cst

from msrewrite.analyze.defuse import function_names
from msrewrite.analyze.guards import guard_path, path_condition, rebuild_path
from msrewrite.analyze.outline import contains, iter_functions
from msrewrite.analyze.walk import Visitor
from msrewrite.emit.templates import code_of, strip_leading
from msrewrite.errors import BadInput
from msrewrite.plan import OverlapPlan
from msrewrite.records import record


@record
class Located:
    """A function of the module and its enclosing class (None for a module-level function)."""

    func: cst.FunctionDef
    cls: cst.ClassDef | None


def locate(module: cst.Module, qualified: str) -> Located:
    for name, func, cls in iter_functions(module):
        if name == qualified:
            return Located(func, cls)
    raise BadInput(f"no function {qualified!r} in the file")


def _find_index(spans: list[tuple[int, int]], line: int, what: str, plan: OverlapPlan) -> int:
    for i, (first, _last) in enumerate(spans):
        if first == line:
            return i
    raise BadInput(f"stale plan for {plan.function}: no statement starts at line {line} ({what})")


# Guarded side branches ------------------------------------------------------------------------------
@record
class GuardedIf:
    """The top-level `if` (statement `index`) whose block, reached through `path` (nested `if`s,
    `elif`s), holds a guarded plan's side statements."""

    index: int
    node: cst.If
    path: list
    block_suite: cst.IndentedBlock

    @property
    def block(self) -> list[cst.BaseStatement]:
        return list(self.block_suite.body)

    @property
    def inside(self) -> range:
        return range(self.index, self.index + len(self.block))

    def rebuild(self, statements: list[cst.BaseStatement]) -> cst.If:
        return rebuild_path(self.path, statements)


def _guarded_if(body, spans, positions, plan: OverlapPlan) -> GuardedIf:
    index = _find_index(spans, plan.guard_line, "guarded if", plan)
    node = body[index]
    if not isinstance(node, cst.If) or not isinstance(node.body, cst.IndentedBlock):
        raise BadInput(f"stale plan for {plan.function}: line {plan.guard_line} is not an `if` with a block")
    first = min(s.first_line for s in plan.side)
    found = guard_path(
        node, lambda part: part in positions and positions[part].start.line <= first <= positions[part].end.line
    )
    if isinstance(found, str) or not isinstance(found[1], cst.IndentedBlock):
        raise BadInput(
            f"stale plan for {plan.function}: no block of the `if` at line {plan.guard_line} holds line {first}"
        )
    expected = path_condition(found[0])
    if plan.guard != expected:  # the guard is emitted as code: it must be the `if`'s own condition
        raise BadInput(
            f"stale plan for {plan.function}: the `if` at line {plan.guard_line} tests {expected!r}, not {plan.guard!r}"
        )
    return GuardedIf(index, node, found[0], found[1])


# Calls hoisted out of the join statement ------------------------------------------------------------
def _if_branches(join: cst.If) -> list[cst.BaseSuite] | None:
    """Every branch of an `if`/`elif` chain, None without a final `else:`."""
    branches: list[cst.BaseSuite] = []
    current = join
    while True:
        branches.append(current.body)
        if current.orelse is None:
            return None  # no else: on that path the call never ran
        if not isinstance(current.orelse, cst.If):
            branches.append(current.orelse.body)
            return branches
        current = current.orelse


def hoisted_calls(join: cst.BaseStatement, source: str) -> list[cst.Call]:
    """The call a hoist names in the join statement: the one occurrence, or, in an `if` whose every
    branch (an `else:` included) is one statement holding it once, the occurrence in each branch."""
    found = [call for call in _calls(join) if code_of(call) == source]
    if len(found) <= 1 or not isinstance(join, cst.If):
        return found if len(found) == 1 else []
    branches = _if_branches(join)
    if branches is None:
        return []
    per_branch = []
    for block in branches:
        inside = [c for c in found if contains(block, c)]
        if len(inside) != 1 or not isinstance(block, cst.IndentedBlock) or len(block.body) != 1:
            return []
        per_branch += inside
    return per_branch if len(per_branch) == len(found) else []


def _calls(node: cst.CSTNode) -> list[cst.Call]:
    found: list[cst.Call] = []

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

    node.visit(_Calls())
    return found


def main_hoist_calls(
    plan: OverlapPlan, body: list[cst.BaseStatement], join: int, taken: set[str]
) -> list[tuple[cst.Call, str]]:
    """(call, temporary) of each main call the plan hoists out of the join statement, found there
    by its text (exactly once: the join statement is one simple statement)."""
    if not plan.main_hoists:
        return []
    stmt = body[join] if join < len(body) else None
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        raise BadInput(
            f"stale plan for {plan.function}: main work is hoisted out of the join at line {plan.join_line}, "
            "which is not one simple statement"
        )
    taken = taken | {s.hoist for s in plan.side if s.hoist}
    found: list[tuple[cst.Call, str]] = []
    for hoist in plan.main_hoists:
        calls = hoisted_calls(stmt, hoist.source)
        if len(calls) != 1:
            raise BadInput(
                f"stale plan for {plan.function}: the join statement at line {plan.join_line} "
                f"does not contain {hoist.source!r} exactly once"
            )
        temp = hoist.hoist or ""  # the plan's checks give every main hoist its temporary
        if temp in taken:
            raise BadInput(
                f"plan for {plan.function}: main hoist temporary {temp!r} is a name the function already uses"
            )
        taken.add(temp)
        found.append((calls[0], temp))
    inner = [a for a, _ in found for b, _ in found if a is not b and contains(b, a)]
    if inner:
        raise BadInput(f"plan for {plan.function}: main hoist {code_of(inner[0])!r} sits inside another one")
    return found


# Side `if`s split over phases ---------------------------------------------------------------------
def _simple_lines(n: cst.If) -> int | None:
    """How many simple statements an `if` (no `else`, nested such `if`s allowed) holds; None for
    any other shape."""
    total = 0
    if n.orelse is not None or not isinstance(n.body, cst.IndentedBlock):
        return None
    for stmt in n.body.body:
        if isinstance(stmt, cst.If):
            inner = _simple_lines(stmt)
            if inner is None:
                return None
            total += inner
        elif isinstance(stmt, cst.SimpleStatementLine):
            total += 1
        else:
            return None
    return total


def _phase_part(n: cst.If, phases: tuple[int, ...], wanted: int, at: list[int]) -> cst.If | None:
    """The `if` holding only its statements of phase `wanted`; `at[0]` counts the statements seen."""
    kept: list[cst.BaseStatement] = []
    block = n.body
    assert isinstance(block, cst.IndentedBlock)  # checked by _simple_lines
    for stmt in block.body:
        if isinstance(stmt, cst.If):
            inner = _phase_part(stmt, phases, wanted, at)
            if inner is not None:
                kept.append(inner)
        else:
            if phases[at[0]] == wanted:
                kept.append(stmt)
            at[0] += 1
    if not kept:
        return None
    kept[0] = kept[0].with_changes(leading_lines=[]) if kept[0] is not block.body[0] else kept[0]
    return n.with_changes(body=block.with_changes(body=kept))


def split_by_phase(node: cst.BaseStatement, phases: tuple[int, ...]) -> dict[int, cst.BaseStatement] | None:
    """A side `if` (no `else`) split by the phase of each simple statement in it (source order):
    phase -> the same `if` holding only that phase's statements (nested `if`s kept where they
    still hold one). None when the `if` does not have exactly that many simple statements."""
    if not isinstance(node, cst.If):
        return None
    if (_simple_lines(node) or 0) != len(phases):
        return None
    out: dict[int, cst.BaseStatement] = {}
    for wanted in sorted(set(phases)):
        found = _phase_part(node, phases, wanted, [0])
        if found is not None:
            out[wanted] = found
    return out


# The layout of one plan's function body ---------------------------------------------------------------
@record
class Layout:
    """A plan's places in its function's body (`body`: the guarded `if`'s block spliced in place of
    the `if`, so that every index below is one of that flat body)."""

    body: list[cst.BaseStatement]
    spans: list[tuple[int, int]]
    guarded: GuardedIf | None
    fork: int
    join: int  # len(body) when the join falls off the function's end
    whole: list[int] = field(default_factory=list)  # side statements, in plan order
    hoists: list[tuple[cst.Call, str]] = field(default_factory=list)  # side calls out of the join statement
    also_hoisted: list[tuple[cst.Call, str]] = field(default_factory=list)  # in the other branches of its `if`
    inner_split: dict[int, dict[int, cst.BaseStatement]] = field(default_factory=dict)  # side `if` -> phase -> part
    phase_of: dict[int, int] = field(default_factory=dict)  # body index (or -1 - hoist number) -> phase
    main_hoisted: list[tuple[cst.Call, str]] = field(default_factory=list)


def _flat_body(func: cst.FunctionDef, positions, plan: OverlapPlan):
    body = list(func.body.body)
    spans = [(positions[s].start.line, positions[s].end.line) for s in body]
    guarded = _guarded_if(body, spans, positions, plan) if plan.guard else None
    if guarded is not None:
        # the `if`'s block spliced in its place: the indices below are those of the flat body
        block_spans = [(positions[s].start.line, positions[s].end.line) for s in guarded.block]
        body = body[: guarded.index] + guarded.block + body[guarded.index + 1 :]
        spans = spans[: guarded.index] + block_spans + spans[guarded.index + 1 :]
    return body, spans, guarded


def layout(func: cst.FunctionDef, positions, plan: OverlapPlan) -> Layout:
    """Where the plan's fork, join and side statements sit in `func` (an indented body)."""
    body, spans, guarded = _flat_body(func, positions, plan)
    if guarded is not None and plan.fork_line == plan.guard_line:
        fork = guarded.index
    else:
        fork = _find_index(spans, plan.fork_line, "fork", plan)
    if guarded is not None and fork > guarded.index:
        raise BadInput(
            f"plan for {plan.function}: a guarded side branch must fork before its `if` (line {plan.guard_line})"
        )
    at_end = plan.join_line == spans[-1][1] + 1  # join when the function falls off its end
    join = len(body) if at_end else _find_index(spans, plan.join_line, "join", plan)
    where = Layout(body, spans, guarded, fork, join)
    for side in plan.side:
        if side.phase > len(plan.phase_anchors):
            raise BadInput(f"plan for {plan.function}: phase {side.phase} has no anchor")
        if side.hoist:
            _place_hoist(where, side, plan)
        else:
            _place_statement(where, side, plan)
    where.main_hoisted = main_hoist_calls(plan, body, join, function_names(func))
    return where


def _place_hoist(where: Layout, side, plan: OverlapPlan) -> None:
    calls = hoisted_calls(where.body[where.join], side.source) if where.join < len(where.body) else []
    if not calls:
        raise BadInput(
            f"stale plan for {plan.function}: the join statement at line {plan.join_line} "
            f"does not contain {side.source!r} exactly once (or once in each branch of its `if`)"
        )
    where.hoists.append((calls[0], side.hoist))
    where.also_hoisted += [(other, side.hoist) for other in calls[1:]]
    where.phase_of[-len(where.hoists)] = side.phase


def _place_statement(where: Layout, side, plan: OverlapPlan) -> None:
    i = _find_index(where.spans, side.first_line, "side statement", plan)
    if code_of(strip_leading(where.body[i])).strip() != side.source.strip():
        raise BadInput(
            f"stale plan for {plan.function}: line {side.first_line} no longer reads {side.source.strip()!r}"
        )
    where.whole.append(i)
    where.phase_of[i] = side.phase
    if not side.inner_phases:
        return
    if not plan.phase_anchors or max(side.inner_phases) > len(plan.phase_anchors):
        raise BadInput(f"plan for {plan.function}: line {side.first_line}: inner phases without their anchors")
    split = split_by_phase(where.body[i], side.inner_phases)
    if split is None:
        raise BadInput(
            f"stale plan for {plan.function}: the `if` at line {side.first_line} does not hold "
            f"{len(side.inner_phases)} statements to split into phases"
        )
    where.inner_split[i] = split
