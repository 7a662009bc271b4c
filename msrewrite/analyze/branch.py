"""Find a side branch inside one function that can move onto a second stream.

Given the seed calls a case cares about (say `self.shared_experts(...)`), decide which statements
form the side branch, where it can fork (as early as its inputs allow) and where it must join
(the first statement that consumes its outputs). A seed call sitting inside a statement that also
needs the main path's result (`h = h + self.shared_experts(x)`) is hoisted into a temporary.

The move is refused, with a reason, when it would change what the code computes:
  - the side branch reads something the main path computes in the overlap window;
  - the main path reads, rebinds or mutates in place (directly or through an alias) a side
    input or output inside the window;
  - the window can leave the function (return) before the join;
  - nothing heavy runs on the main path inside the window, so there is nothing to overlap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import TYPE_CHECKING

import libcst as cst
from libcst.metadata import CodeRange

from msrewrite.analyze.defuse import (
    MODULE_STATE_TABLES,
    Scope,
    StatementFacts,
    alias_roots,
    all_calls,
    dotted_name,
    expression_loads,
    function_names,
    is_docstring,
    node_facts,
    statement_facts,
)
from msrewrite.analyze.guards import (
    Guard,
    assigned_self_attrs,
    guard_path,
    invariance_problem,
    negate,
    path_condition,
    source,
)
from msrewrite.analyze.outline import unique_name
from msrewrite.analyze.summaries import (
    ALL_STATE_TOKENS,
    BUILTIN_NAMES,
    STATE_ACCESSORS,
    STATE_WRITERS,
    Storage,
    self_chain,
    unseen_writers,
)
from msrewrite.analyze.value_kinds import IMMUTABLE, OBJECT_PREFIX, ValueKinds, is_object
from msrewrite.analyze.walk import Visitor, walk
from msrewrite.analyze.wrappers import flattened, is_transparent, opaque_context, placement, top_level_withs
from msrewrite.records import record

if TYPE_CHECKING:
    from msrewrite.analyze.torch_effects import CallEffect


@record
class Hoist:
    """A side call lifted out of the join statement into a temporary of its own (`temp`)."""

    call: cst.Call
    temp: str
    source: str
    first_line: int
    last_line: int
    # the same call in the other branches of the join's `if` (each branch runs it once)
    also: tuple[cst.Call, ...] = ()


@record
class SideBranch:
    """The side work of a function: the statements and hoisted calls that move, and where they fork and join."""

    statements: list[StatementFacts]  # whole statements that move, in order
    hoists: list[Hoist]  # seed calls lifted out of the join statement
    fork: int  # body index the side block goes before
    join: int  # body index of the first consumer
    inputs: list[str]
    outputs: list[str]
    rebound_inputs: list[str]  # inputs the main path rebinds before the join
    maybe_outputs: list[str] = field(default_factory=list)  # bound only on some paths (inside an if)
    phases: dict[int, int] = field(default_factory=dict)  # side statement index -> phase
    # a side `if` split over phases: index -> the phase of each simple statement in it, in order
    inner_phases: dict[int, tuple[int, ...]] = field(default_factory=dict)
    phase_anchors: list[str] = field(default_factory=list)
    facts: list[StatementFacts] = field(default_factory=list)
    # The side statements sit inside this `if` (its block is spliced into `facts`, so indices are
    # those of the function with the block flattened in place of the `if`).
    guard: Guard | None = None
    # inputs the main path may write inside the window, snapshot at the fork (--protect auto/clone)
    protected_inputs: list[str] = field(default_factory=list)
    # callees the side branch and the window call that msrewrite could not see into
    trust_boundary: list[str] = field(default_factory=list)
    # why moving the side work changes the order of random draws (dropout, torch.rand*), or ""
    rng_reorder: str = ""
    # Main calls hoisted out of the join statement into temporaries right before the join, on the
    # flag-on path only, when they are the only main work of the window (the flag-off path keeps
    # the join statement as it is): `h = self.experts(h) + shared` -> `experts_output =
    # self.experts(h)`, join, `h = experts_output + shared`.
    main_hoists: list[Hoist] = field(default_factory=list)


class NoBranch(Exception):
    """The function has seed calls but no branch that can safely move; the message says why.

    `vouch`: the --assume-pure names that lift this refusal (every unseen callee it names has
    one); `clone`: --protect clone lifts it (a snapshot at the fork). The finder tries them to
    name every blocker of a function in one refusal (cases/_finder.py). `structural`: the shape
    of the function refuses it whatever callees do (nothing to overlap, a `with` msrewrite cannot
    see through): no option lifts it, and vouching for callees cannot either, so the finder
    names it alone."""

    def __init__(
        self, message: str = "", vouch: tuple[str, ...] = (), clone: bool = False, structural: bool = False
    ) -> None:
        super().__init__(message)
        self.vouch, self.clone, self.structural = vouch, clone, structural


def vouch_for(callees: list[str]) -> tuple[str, ...]:
    """The --assume-pure names that lift a refusal naming `callees`, or () when one of them has no
    name --assume-pure takes (vouching for the rest would not lift it)."""
    names = vouch_names(callees)
    return tuple(names) if all(names) else ()


SeedPredicate = Callable[[str], bool]  # dotted callee after "self." -> is it side work?


def _seed_calls(node: cst.CSTNode, is_seed: SeedPredicate) -> list[cst.Call]:
    found: list[cst.Call] = []

    on_call = getattr(is_seed, "on_call", None)  # seeds that are not submodule calls (dist.send)

    class _Finder(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            if on_call is not None:
                if on_call(call):
                    found.append(call)
                return
            callee = dotted_name(call.func)
            if callee and callee.startswith("self.") and is_seed(callee[len("self.") :]):
                found.append(call)

        def visit_FunctionDef(self, _n: cst.FunctionDef) -> bool:
            return False

    if isinstance(node, cst.FunctionDef):
        node = node.body
    node.visit(_Finder())
    return found


def has_seed(node: cst.CSTNode, is_seed: SeedPredicate) -> bool:
    return bool(_seed_calls(node, is_seed))


def _temp_name(callee: str, taken: set[str]) -> str:
    return unique_name(callee.split(".")[-1] + "_output", taken)


def find_side_branch(
    func: cst.FunctionDef,
    positions: dict[cst.CSTNode, CodeRange],
    is_seed: SeedPredicate,
    anchors: tuple[str, ...] = (),
    phase_anchors: tuple[str, ...] | None = None,
    scope: Scope | None = None,
    protect: bool = False,
) -> SideBranch:
    """The side branch of `func`; `anchors` are main-stream values the side must start after.

    A side call inside an `if` that also does main work (or consumes the side result) is tried
    again with that `if` split into a guarded fork and a guarded join, when its condition is
    invariant over the window (analyze/guards.py).

    `scope` resolves calls (summaries.py); with it, callees msrewrite cannot see into may write
    their arguments. `protect`: a side input the main path may write inside the window is
    snapshot at the fork instead of refusing the move.

    A top-level `with` of a context manager that neither orders nor frees tensors
    (analyze/wrappers.py) is looked through: when the side branch found with its block flattened
    joins inside it, forking inside it or (side work before it) before it, that is the branch (the
    edit goes into the `with`). Else the function is analysed as written, and when that refuses
    while a `with` msrewrite cannot see through would hold the join, the refusal names it."""
    suspends = _suspends(func)
    if suspends:
        raise NoBranch(
            f"{func.name.value}() is {suspends}: it may suspend between the fork and the join, with the side "
            "stream's work in flight or the side stream current; msrewrite edits plain functions only",
            structural=True,
        )
    declared = _declared_emitted_names(func)
    if declared:
        raise NoBranch(
            f"{func.name.value}() declares `global`/`nonlocal` {', '.join(declared)}, a name the edit's own code "
            "uses in the function; Python rejects a use before such a declaration",
            structural=True,
        )
    args = (positions, is_seed, anchors, phase_anchors, scope, protect)
    withs = top_level_withs(func)
    if not withs:
        return _find_in_body(func, *args)
    inside_reason: NoBranch | None = None
    for at, node in withs:
        if not is_transparent(node):
            continue
        try:  # side work inside the `with` forks no earlier than its block: it keeps its context
            branch = _find_in_body(flattened(func, at, node), *args, min_fork=at)
        except NoBranch as inside:
            inside_reason = inside_reason or inside
            continue
        if _placement(func, at, node, branch, positions) is not None:
            return branch
    try:
        return _find_in_body(func, *args)
    except NoBranch as unsplit:
        opaque = _opaque_with_refusal(func, withs, args, positions)
        if opaque is not None:
            raise opaque from None
        if inside_reason is not None and "does not split" in str(unsplit):
            raise inside_reason from None  # the reason found inside the `with`
        raise


def _placement(
    func: cst.FunctionDef, at: int, node: cst.With, branch: SideBranch, positions: dict[cst.CSTNode, CodeRange]
) -> str | None:
    """wrappers.placement of `branch` (found with the `with` at `at` flattened) against that `with`."""
    facts = branch.facts
    fork_line = facts[min(branch.fork, len(facts) - 1)].first_line
    join_line = facts[branch.join].first_line if branch.join < len(facts) else None
    side_lines = [f.first_line for f in branch.statements] + [h.first_line for h in branch.hoists]
    if any(branch.phases.values()) or (branch.guard is not None and fork_line < positions[node].start.line):
        return None  # phases and guarded `if`s re-enter the stream at places the `with` would split
    is_last = at == len(func.body.body) - 1  # type: ignore[union-attr]
    return placement(node, positions[node], is_last, fork_line, join_line, side_lines)


def _opaque_with_refusal(
    func: cst.FunctionDef, withs: list[tuple[int, cst.With]], args: tuple, positions: dict[cst.CSTNode, CodeRange]
) -> NoBranch | None:
    """The refusal naming a `with` msrewrite cannot see through, when it holds side calls and main
    work (the side work can move neither out of it nor with a fork and join inside it), or when the side branch found
    with its block flattened would join inside it; else None."""
    is_seed = args[1]
    for at, node in withs:
        if is_transparent(node):
            continue
        span = positions[node]
        named = (
            f"`with {opaque_context(node)}:` (line {span.start.line}), a context manager msrewrite cannot see through"
        )
        if has_seed(node, is_seed) and _main_work(is_seed)(node):
            return NoBranch(
                f"the side call sits inside {named}: its enter or exit may order streams or free tensors, so "
                "the side work is not moved out of it nor a fork and join into it",
                structural=True,
            )
        try:
            branch = _find_in_body(flattened(func, at, node), *args)
        except NoBranch:
            continue
        facts = branch.facts
        join_line = facts[branch.join].first_line if branch.join < len(facts) else None
        is_last = at == len(func.body.body) - 1  # type: ignore[union-attr]
        if (join_line is None and is_last) or (join_line is not None and span.start.line < join_line <= span.end.line):
            return NoBranch(
                f"the join falls inside {named}: its enter or exit may order streams or free tensors, so the "
                "join is not moved into it",
                structural=True,
            )
    return None


_EMITTED_NAMES = frozenset({"torch", "os", "torch_npu", "torchair"})  # and msrewrite's own `_ms_*` helpers


def _declared_emitted_names(func: cst.FunctionDef) -> list[str]:
    """Names the emitted code uses that the function declares `global` or `nonlocal`."""
    found: list[str] = []

    class _Declarations(Visitor):
        def _names(self, node: cst.Global | cst.Nonlocal) -> None:
            for item in node.names:
                name = item.name.value
                if name in _EMITTED_NAMES or name.startswith("_ms_"):
                    found.append(name)

        def visit_Global(self, node: cst.Global) -> None:
            self._names(node)

        def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
            self._names(node)

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is func

        def visit_ClassDef(self, _node: cst.ClassDef) -> bool:
            return False

    func.visit(_Declarations())
    return found


def _suspends(func: cst.FunctionDef) -> str:
    """ "an async function" / "a generator" (a `yield` of its own, not of a nested function), or ""."""
    if func.asynchronous is not None:
        return "an async function"

    class _Yields(Visitor):
        found = False

        def visit_Yield(self, _node: cst.Yield) -> None:
            self.found = True

        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is func

        def visit_Lambda(self, _node: cst.Lambda) -> bool:
            return False

        def visit_ClassDef(self, _node: cst.ClassDef) -> bool:
            return False

    yields = _Yields()
    func.visit(yields)
    return "a generator" if yields.found else ""


def _find_in_body(
    func: cst.FunctionDef,
    positions: dict[cst.CSTNode, CodeRange],
    is_seed: SeedPredicate,
    anchors: tuple[str, ...],
    phase_anchors: tuple[str, ...] | None,
    scope: Scope | None,
    protect: bool,
    min_fork: int = 0,
) -> SideBranch:
    """The side branch of `func` as written; `min_fork`: the body index the fork goes no earlier
    than, unless a side statement comes first (not applied with an `if` split: its indices differ)."""
    body = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    scope = scope or Scope()
    facts = statement_facts(body, positions, scope)
    calls = [c for f in facts for c in f.self_calls]
    if calls and all(is_seed(c) for c in calls) and not any(_calls_super(f.node) for f in facts):
        # a helper of the side work itself (`_forward_shared_experts`, a gate helper): it is what
        # moves, where it is called; here nothing else runs
        side = ", ".join(f"self.{c}" for c in dict.fromkeys(calls))
        raise NoBranch(
            f"{func.name.value}() calls no submodule besides the side work ({side}): nothing to overlap it "
            "with here; the overlap belongs where it is called",
            structural=True,
        )
    try:
        return _find_side_branch(
            func, body, facts, positions, is_seed, anchors, phase_anchors, None, scope, protect, min_fork
        )
    except NoBranch as unsplit:
        guard = _splittable_if(func, facts, is_seed, scope)
        if guard is None:
            raise
        if isinstance(guard, str):
            # the split's reason, unless the unsplit analysis found a more specific one
            generic = any(
                w in str(unsplit) for w in ("does not split", "conditional inside the join", "nothing to overlap")
            )
            if generic:
                raise NoBranch(guard) from None
            raise unsplit from None
        holder = facts[guard.index].node
        assert isinstance(holder, cst.If)  # _splittable_if returns a guard only for an `if`
        block = _guarded_block(holder, is_seed)
        flat = body[: guard.index] + block + body[guard.index + 1 :]
        flat_facts = _under_guard(statement_facts(flat, positions, scope), guard, func, scope)
        try:
            return _find_side_branch(
                func, body, flat_facts, positions, is_seed, anchors, phase_anchors, guard, scope, protect
            )
        except NoBranch as split:
            if "does not split" in str(unsplit) or "conditional inside the join" in str(unsplit):
                raise NoBranch(
                    f"{split} (with the `if` at line {guard.line} split)",
                    vouch=split.vouch,
                    clone=split.clone,
                    structural=split.structural,
                ) from None
            raise unsplit from None


def _conjuncts(condition: str) -> list[str]:
    """The parts of `a and b and c`, each written without outer parentheses."""
    parts: list[str] = []

    def walk(expr: cst.BaseExpression) -> None:
        if isinstance(expr, cst.BooleanOperation) and isinstance(expr.operator, cst.And):
            walk(expr.left)
            walk(expr.right)
        else:
            parts.append(source(expr.with_changes(lpar=[], rpar=[])) if hasattr(expr, "lpar") else source(expr))

    walk(cst.parse_expression(condition))
    return parts


def _under_guard(
    facts: list[StatementFacts], guard: Guard, func: cst.FunctionDef, scope: Scope
) -> list[StatementFacts]:
    """The flattened facts as they are when the guard holds, which is the only time the side work
    runs: a binding before the `if` that tests the same invariant condition
    (`identity = h.clone() if self.shared_experts is not None else h`, SGLang's sarvam_moe.py)
    binds the branch that condition picks, so `identity` aliases only what `h.clone()` does.
    Only when the test reads nothing the function changes between that binding and the `if`."""
    wanted = _conjuncts(guard.condition)
    params = {p.name.value for p in (*func.params.params, *func.params.kwonly_params, *func.params.posonly_params)}
    local_names = params | {name for f in facts for name in f.stores}
    out = list(facts)
    for f in facts[: guard.index]:
        node = f.node
        if not (
            isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1 and isinstance(node.body[0], cst.Assign)
        ):
            continue
        assign = node.body[0]
        value = assign.value
        if (
            not isinstance(value, cst.IfExp)
            or len(assign.targets) != 1
            or not isinstance(assign.targets[0].target, cst.Name)
        ):
            continue
        test = value.test.with_changes(lpar=[], rpar=[]) if hasattr(value.test, "lpar") else value.test
        if source(test) in wanted:
            taken = value.body
        elif negate(test) in wanted:
            taken = value.orelse
        else:
            continue
        problem, locals_read = invariance_problem(test, func, facts, local_names)
        if problem or any((g.stores | g.mutates) & locals_read for g in facts[f.index : guard.index]):
            continue
        specialized = node_facts(assign.with_changes(value=taken), scope)
        out[f.index] = dataclasses.replace(f, links=set(specialized.links))
    return out


def _every_branch_calls(
    node: cst.If, is_seed: SeedPredicate, func: cst.FunctionDef, facts: list[StatementFacts], local_names: set[str]
) -> list[cst.Call] | None:
    """The side call of each branch, when every branch of the join's `if` (an `else:` included,
    `elif`s followed) is one simple statement calling the very same side call once, outside any
    conditional part of it, and every test is invariant (so it reads nothing the call could change,
    and calls nothing): transformers' HY-V3 `if self.fp32: h = (r.float() + self.shared(x).float())...
    else: h = r + self.shared(x)`. The call then runs exactly once on every path, as it would when
    hoisted before the `if`. None otherwise."""
    calls: list[cst.Call] = []
    current: cst.BaseStatement | None = node
    while isinstance(current, cst.If):
        if invariance_problem(current.test, func, facts, local_names)[0] or has_seed(current.test, is_seed):
            return None
        blocks = [current.body]
        orelse = current.orelse
        if orelse is None:
            return None  # no else: the call does not run when the tests fail
        if isinstance(orelse, cst.If):
            current = orelse
        else:
            blocks.append(orelse.body)
            current = None
        for block in blocks:
            if not isinstance(block, cst.IndentedBlock) or len(block.body) != 1:
                return None
            stmt = block.body[0]
            if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
                return None
            found = _seed_calls(stmt, is_seed)
            if len(found) != 1 or id(found[0]) in _conditional_calls(stmt):
                return None
            calls.append(found[0])
    sources = {cst.Module(body=[]).code_for_node(c) for c in calls}
    return calls if len(sources) == 1 else None


def _alias_origin(
    storage: Storage, facts: list[StatementFacts], name: str, group: frozenset, before: int, scope: Scope
) -> str:
    """', which may hold the storage of 'x' (bound at line N from <callee>, ...)': where `name`
    came to share the side input's storage (`group`), for a refusal that names a write to it."""
    inputs = sorted({token[1] for token in group if len(token) == 2})
    what = f"'{inputs[0]}'" if inputs else "a side input"
    # where it came to share the input's own storage (an unseen `store(lst, x)` also makes x hold
    # lst's earlier object: that earlier binding is not where the input got in)
    group = frozenset(t for t in group if len(t) == 2) or group
    for g in facts[: before + 1]:  # the write's own statement too (an `if` that binds and writes)
        if (
            name in g.stores | {t for _, t in g.links}
            and storage.held(name, g.index + 1) & group
            and not storage.held(name, g.index) & group
        ):
            where = f"at line {g.first_line}"
            unseen = sorted(g.unknown_callees)
            if not isinstance(g.node, cst.SimpleStatementLine):
                # a compound statement: the binding inside it that takes an unseen callee's result
                where = f"in the {type(g.node).__name__.lower()} at line {g.first_line}"
                inner = [node_facts(line, scope) for line in _simple_lines(g.node)]
                unseen = next(
                    (
                        sorted(i.unknown_callees)
                        for i in inner
                        if name in i.stores | {t for _, t in i.links} and i.unknown_callees
                    ),
                    [],
                )
            storer = _storing_callee(g.node, name, scope)
            if storer is not None:
                return f", which may hold the storage of {what} (stored in it {where} by {storer}),"
            source = f" from {unseen[0]}, which may return its argument" if unseen else ""
            return f", which may hold the storage of {what} (bound {where}{source}),"
    return f", which may hold the storage of {what},"


def _storing_callee(node: cst.CSTNode, name: str, scope: Scope) -> str | None:
    """The first call in `node` that may store something in the object `name` names (`put(lst, x)`,
    `lst.append(x)`, `setattr(o, "a", x)`): the callee, as a refusal names it; None when none does."""
    for call in all_calls(node):
        effect = scope.effect_of(call)
        if any(name in alias_roots(container, scope) for container, _ in effect.stores):
            label = dotted_name(call.func) or cst.Module(body=[]).code_for_node(call.func)
            if effect.unknown and not effect.unknown[0].startswith(label):
                return f"{label} -> {effect.unknown[0]}"  # put(lst, x) -> buf.append (not visible ...)
            return effect.unknown[0] if effect.unknown else label
    return None


def _simple_lines(node: cst.CSTNode) -> list[cst.SimpleStatementLine]:
    found: list[cst.SimpleStatementLine] = []

    class _Lines(Visitor):
        def visit_SimpleStatementLine(self, n: cst.SimpleStatementLine) -> bool:
            found.append(n)
            return False

        def visit_FunctionDef(self, _n: cst.FunctionDef) -> bool:
            return False

    node.visit(_Lines())
    return found


def _read_first(node: cst.BaseStatement, stored: frozenset[str] = frozenset()) -> set[str]:
    """Names a statement reads before it stores them itself: an `if` statement by statement, each
    branch from what was stored before the `if` (a store in one branch does not count for the other)."""
    if not isinstance(node, cst.If):
        return node_facts(node).loads - stored
    found = node_facts(node.test).loads - stored
    branches = [node.body, node.orelse.body if isinstance(node.orelse, cst.Else) else node.orelse]
    for branch in branches:
        if branch is None:
            continue
        if isinstance(branch, cst.If):
            found |= _read_first(branch, stored)
            continue
        if not isinstance(branch, cst.IndentedBlock):
            found |= node_facts(branch).loads - stored
            continue
        inner = set(stored)
        for stmt in branch.body:
            found |= _read_first(stmt, frozenset(inner))
            inner |= node_facts(stmt).stores if not isinstance(stmt, cst.If) else set()
    return found


def _simple_names(node: cst.CSTNode) -> list[str]:
    names: list[str] = []

    class _Names(Visitor):
        def visit_Name(self, n: cst.Name) -> None:
            names.append(n.value)

    node.visit(_Names())
    return names


def _super_calls(node: cst.CSTNode) -> list[str]:
    """`super().forward(x)` -> ['super().forward']: the base class's work, main work like a submodule call."""
    found: list[str] = []

    class _Super(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            func = call.func
            if (
                isinstance(func, cst.Attribute)
                and isinstance(func.value, cst.Call)
                and dotted_name(func.value.func) == "super"
            ):
                found.append(f"super().{func.attr.value}")

    node.visit(_Super())
    return found


def _calls_super(node: cst.CSTNode) -> bool:
    return bool(_super_calls(node))


def _main_work(is_seed: SeedPredicate) -> Callable[[cst.CSTNode], bool]:
    """Does a block call a submodule that is not side work (`self.experts(h)`)?"""
    return lambda part: any(not is_seed(c) for c in node_facts(part).self_calls)


def _guarded_block(node: cst.If, is_seed: SeedPredicate) -> list[cst.BaseStatement]:
    found = guard_path(node, lambda part: has_seed(part, is_seed), _main_work(is_seed))
    assert not isinstance(found, str)  # _splittable_if found the same path
    block = found[1]
    assert isinstance(block, cst.IndentedBlock)  # _splittable_if refuses a one-line body
    return list(block.body)


def _splittable_if(
    func: cst.FunctionDef, facts: list[StatementFacts], is_seed: SeedPredicate, scope: Scope | None = None
) -> Guard | str | None:
    """The one top-level `if` holding the side calls, when its condition is invariant; a reason
    when it is there but cannot be split; None when no `if` holds them."""
    holders = [f for f in facts if isinstance(f.node, cst.If) and has_seed(f.node, is_seed)]
    if not holders:
        return None
    if len(holders) > 1 or any(has_seed(f.node, is_seed) for f in facts if f not in holders):
        return None  # side calls in several places: the unsplit analysis's reason stands
    holder = holders[0]
    node = holder.node
    assert isinstance(node, cst.If)
    found = guard_path(node, lambda part: has_seed(part, is_seed), _main_work(is_seed))
    if isinstance(found, str):
        return f"line {holder.first_line}: {found}"
    path, block = found
    if not isinstance(block, cst.IndentedBlock):
        return f"line {holder.first_line}: a one-line `if` body cannot be split"
    params = {p.name.value for p in (*func.params.params, *func.params.kwonly_params, *func.params.posonly_params)}
    local_names = params | {name for f in facts for name in f.stores}
    read: set[str] = set()
    # every test on the way is evaluated again at the fork: each must be invariant
    for step, _ in path:
        problem, locals_read = invariance_problem(step.test, func, facts, local_names, scope)
        if problem:
            return (
                f"line {holder.first_line}: the side call is inside `if {source(step.test)}`, whose condition "
                f"{problem}: it may not read the same at an earlier fork"
            )
        read |= locals_read
    in_orelse = len(path) == 1 and path[0][1]
    return Guard(holder.index, holder.first_line, path_condition(path), in_orelse, frozenset(read), len(block.body))


def _find_side_branch(
    func: cst.FunctionDef,
    body: list[cst.BaseStatement],
    facts: list[StatementFacts],
    positions: dict[cst.CSTNode, CodeRange],
    is_seed: SeedPredicate,
    anchors: tuple[str, ...],
    phase_anchors: tuple[str, ...] | None,
    guard: Guard | None,
    scope: Scope,
    protect: bool,
    min_fork: int = 0,
) -> SideBranch:
    """The side branch over `facts` (a guarded `if`'s block flattened in when `guard` is set)."""
    search = _Search(func, body, facts, positions, is_seed, anchors, phase_anchors, guard, scope, protect)
    search.min_fork = min_fork
    return search.run()


def _exit_line(node: cst.CSTNode, positions: dict[cst.CSTNode, CodeRange]) -> int | None:
    """The line of the first `return`, `raise` or `assert` in `node` (nested functions aside)."""
    found: list[cst.CSTNode] = []

    class _Exits(Visitor):
        def visit_Return(self, n: cst.Return) -> None:
            found.append(n)

        def visit_Raise(self, n: cst.Raise) -> None:
            found.append(n)

        def visit_Assert(self, n: cst.Assert) -> None:
            found.append(n)

        def visit_FunctionDef(self, _n: cst.FunctionDef) -> bool:
            return False

    node.visit(_Exits())
    lines = [positions[n].start.line for n in found if n in positions]
    return min(lines) if lines else None


def _past_early_exits(seeds: list[StatementFacts]) -> list[StatementFacts]:
    """The seed statements that make the side branch: an `if` that may leave the function before
    the rest of the side work (`if not self.tp: return self.shared_experts(x)`) is left where it
    is, its side calls on the main stream as they were. The fork comes after it (an early exit
    before the side work, _fork_after_inputs), so a path that leaves there never forks, and one
    that falls through has run the `if` exactly as the original did."""
    early = 0
    while early < len(seeds) - 1 and isinstance(seeds[early].node, cst.If) and seeds[early].exits:
        early += 1
    return seeds[early:]


def _own_first(names: list[str], name: str) -> list[str]:
    """`names` sorted, `name` (the side input's own name) first."""
    return sorted(names, key=lambda n: (n != name, n))


# (body index a side unit sits at, the names it reads as inputs, the names it stores)
_Unit = tuple[int, set[str], set[str]]


class _Search:
    """One run of the side-branch analysis of a function: `run` takes the steps in order, each
    a method that computes one part of the branch or refuses it with NoBranch."""

    min_fork = 0  # the fork goes no earlier than this body index (a `with`'s block), side work aside

    def __init__(
        self,
        func: cst.FunctionDef,
        body: list[cst.BaseStatement],
        facts: list[StatementFacts],
        positions: dict[cst.CSTNode, CodeRange],
        is_seed: SeedPredicate,
        anchors: tuple[str, ...],
        phase_anchors: tuple[str, ...] | None,
        guard: Guard | None,
        scope: Scope,
        protect: bool,
    ) -> None:
        self.func, self.body, self.facts, self.positions = func, body, facts, positions
        self.is_seed, self.anchors, self.phase_anchors = is_seed, anchors, phase_anchors
        self.guard, self.scope, self.protect = guard, scope, protect
        self.params = {
            p.name.value for p in (*func.params.params, *func.params.kwonly_params, *func.params.posonly_params)
        }
        self.local_names = self.params | {name for f in facts for name in f.stores}
        self.written_in_place: set[str] = set()  # snapshot inputs the source itself writes in place
        # main statements the fork waits for only because an unseen callee may write a side
        # input there: (index, the name written) -> those callees
        self.unseen_pushes: dict[tuple[int, str], list[str]] = {}

    def reaching_def(self, name: str, before: int, skip: set[int]) -> int | None:
        """The last statement before `before` (outside `skip`) that binds `name`."""
        for f in reversed(self.facts[:before]):
            if f.index not in skip and name in f.stores:
                return f.index
        return None

    def run(self) -> SideBranch:
        facts, guard = self.facts, self.guard
        seeds = [f for f in facts if has_seed(f.node, self.is_seed)]
        if not seeds:
            raise NoBranch("no side-branch call in this function")
        seeds = _past_early_exits(seeds)
        self._check_seed_statements(seeds)
        depends_on_main = self._main_dependence(seeds)
        pure = self._side_statements(seeds, depends_on_main)
        whole = [facts[i] for i in sorted(pure)]
        impure = [f for f in seeds if depends_on_main[f.index]]
        side_idx = {f.index for f in whole}
        side_stores, outputs = self._side_outputs(whole, side_idx)
        join = self._join(side_idx, impure, outputs, whole)
        taken = function_names(self.func)
        hoists = self._side_hoists(facts[join], impure, taken)
        outputs.extend(h.temp for h in hoists)
        units, hoist_facts, inputs = self._side_inputs(whole, hoists, join)
        fork = self._fork_after_inputs(units, inputs, side_idx, join, hoists, side_stores)
        # Storage each input may share (views, containers, attributes), from the bindings before the join.
        storage = Storage(facts, self.params)
        groups = self._input_groups(units, inputs, storage)
        fork, pushed_by = self._fork_after_writes(units, groups, storage, side_idx, fork)
        placed = [dataclasses.replace(f, first_line=h.first_line) for h, f in zip(hoists, hoist_facts, strict=True)]
        side_state = self._side_state([*whole, *placed], [h.call for h in hoists], storage)
        fork, pushed_by = self._fork_after_barriers(
            units, side_idx, hoists, *self._fork_after_state(units, side_idx, side_state, storage, fork, pushed_by)
        )
        fork = self._fork_after_anchors(fork, join, side_idx)
        fork = max(fork, min(self.min_fork, *side_idx, join))  # a later fork only shortens the window
        self._check_rebound_inputs(units, inputs, side_idx, fork)
        start = min([fork, *side_idx])
        if hoists:
            _check_join_statement(facts[join], hoists, hoist_facts, storage, self.is_seed, self.scope)
            self._check_join_state(facts[join], hoists, side_state, storage)
        window = [f for f in facts[fork:join] if f.index not in side_idx]
        main_hoists, main_hoist_facts = self._main_hoists(join, window, side_stores, taken)
        every_input = frozenset().union(*groups.values()) if groups else frozenset()
        main = [g for g in facts[start:join] if g.index not in side_idx] + main_hoist_facts
        protected = self._check_window(
            [*facts[start:join], *main_hoist_facts],
            side_idx,
            fork,
            groups,
            storage,
            outputs,
            side_stores,
            lambda: self._side_writes(whole, hoist_facts, join, main, storage, every_input)[1],
        )
        protected = self._snapshot_inputs(protected, fork, side_stores)
        window += main_hoist_facts
        if not main_hoists and not any(f.has_call and f.self_calls for f in window):
            raise self._nothing_to_overlap(join, fork, pushed_by, storage)
        self._check_main_against_side(whole, hoist_facts, hoists, join, main, storage, every_input, side_state)

        if guard is not None:
            _check_guard(guard, facts, fork, join, side_idx, guard.size)
        rebound = sorted({name for f in window for name in f.stores if name in inputs})
        maybe = _maybe_outputs(outputs, whole)
        phases, inner_phases, chosen_anchors = self._phases(whole, fork, join, side_idx, inputs)
        rng = _check_order(facts, whole, hoists, start, join, side_idx, self.scope, bool(main_hoists))
        return SideBranch(
            rng_reorder=rng,
            phases=phases,
            inner_phases=inner_phases,
            phase_anchors=chosen_anchors,
            maybe_outputs=maybe,
            protected_inputs=protected,
            trust_boundary=self._trust_boundary([*whole, *hoist_facts, *window], fork, side_idx),
            main_hoists=main_hoists,
            statements=whole,
            hoists=hoists,
            fork=fork,
            join=join,
            inputs=inputs,
            outputs=outputs,
            rebound_inputs=rebound,
            facts=facts,
            guard=guard,
        )

    def _check_main_against_side(
        self,
        whole: list[StatementFacts],
        hoist_facts: list[StatementFacts],
        hoists: list,
        join: int,
        main: list[StatementFacts],
        storage: Storage,
        every_input: frozenset,
        side_state: _SideState,
    ) -> None:
        """What the side writes against what main reads, and module state either side changes."""
        self._check_side_writes(whole, hoist_facts, join, main, storage, every_input)
        self._check_module_state([*whole, *hoist_facts], [h.call for h in hoists], main, storage)
        for g in main:
            clash = self._state_clash(g, side_state, storage)
            if clash:
                raise NoBranch(clash)

    def _snapshot_inputs(self, protected: list[str], fork: int, side_stores: list[str]) -> list[str]:
        """The inputs to snapshot at the fork, by what the source says they hold there: an
        immutable value (None, a number, a string) cannot be written in place and needs none; an
        object of a named class cannot be copied by a snapshot, nor an input the side rebinds, so
        the move is refused."""
        if not protected:
            return protected
        rebound_by_side = [name for name in protected if name in side_stores]
        if rebound_by_side:
            raise NoBranch(
                f"'{rebound_by_side[0]}' is both read and rebound by the side branch; --protect clone cannot snapshot it"
            )
        kinds = ValueKinds(self.func, [f.node for f in self.facts])
        of = {name: kinds.of(name, fork) for name in protected}
        for name in protected:
            if is_object(of[name]):
                cls = of[name].removeprefix(OBJECT_PREFIX)
                raise NoBranch(
                    f"the main path may write '{name}' while the side stream reads it, and '{name}' is a {cls}: "
                    "a snapshot copies tensors (also in tuples, lists and dicts), not the state of a "
                    f"{cls}"
                )
        # an annotation `flag: bool` is trusted to mean nothing can write it in place, unless the
        # source does so itself (then the annotation is wrong: the snapshot is made anyway)
        return [name for name in protected if of[name] != IMMUTABLE or name in self.written_in_place]

    def _trust_boundary(self, moved: list[StatementFacts], fork: int, side_idx: set[int]) -> list[str]:
        """The callees not seen into of the side work and the window, and of the waits before the
        fork that msrewrite could not see into (it took them as stream ordering: the fork follows them)."""
        waits = [f for f in self.facts[:fork] if f.barrier and f.index not in side_idx]
        return sorted({u for f in [*moved, *waits] for u in f.unknown_callees | f.unseen_work})

    def _input_groups(self, units: list[_Unit], inputs: list[str], storage: Storage) -> dict[str, frozenset]:
        """The objects each side input names where the side reads it."""
        groups: dict[str, frozenset] = {}
        for index, loads, _ in units:
            for name in loads & set(inputs) & self.local_names:
                groups[name] = groups.get(name, frozenset()) | storage.held(name, index)
        return groups

    def _phases(
        self, whole: list[StatementFacts], fork: int, join: int, side_idx: set[int], inputs: list[str]
    ) -> tuple[dict[int, int], dict[int, tuple[int, ...]], list[str]]:
        """(phase of each side statement, inner phases of a split side `if`, the anchors used):
        all empty unless phases were asked for."""
        if self.phase_anchors is None:
            return {}, {}, []
        chosen_anchors = list(self.phase_anchors) or derive_phase_anchors(self.facts, fork, join, side_idx)
        phases, inner_phases = _assign_phases(
            self.func, self.facts, whole, chosen_anchors, fork, join, side_idx, self.reaching_def, set(inputs)
        )
        return phases, inner_phases, chosen_anchors

    def _check_seed_statements(self, seeds: list[StatementFacts]) -> None:
        """Refuses a compound statement holding side calls unless it moves whole: an `if` whose
        calls are all side work (or that is side work as a whole) and that cannot leave the function."""
        for f in seeds:
            if isinstance(f.node, cst.SimpleStatementLine):
                continue
            # `if self.shared_experts is not None: out = self.shared_experts(x)` moves as one unit,
            # as long as everything it calls is side work and it cannot leave the function.
            if isinstance(f.node, cst.If) and f.exits:
                leaves = "raises" if f.raises and not _returns(f.node) else "returns"
                at = _exit_line(f.node, self.positions)
                started = (
                    f" after the side work at line {seeds[0].first_line} has started: that path would leave "
                    "without joining the side stream"
                    if f is not seeds[0]
                    else ""
                )
                raise NoBranch(
                    f"line {f.first_line}: the side-branch call sits inside `if {source(f.node.test)}`, which "
                    f"{leaves} from the function{f' at line {at}' if at else ''}{started}; msrewrite does not "
                    "split an `if` that leaves the function"
                )
            if (
                not isinstance(f.node, cst.If)
                or f.exits
                or not (all(self.is_seed(c) for c in f.self_calls) or _side_only_if(f, self.func, self.facts))
            ):
                raise NoBranch(
                    f"line {f.first_line}: the side-branch call sits inside {_compound_label(f.node)} "
                    "that also does other work, which msrewrite does not split"
                )

    def _main_dependence(self, seeds: list[StatementFacts]) -> dict[int, bool]:
        """Statement index -> does it depend on main work?

        Main work = statements calling submodules outside the side branch, and everything that
        reads their results. A seed statement that depends on main work is the join; its seed
        calls are hoisted out of it instead."""
        facts = self.facts
        seed_idx = {f.index for f in seeds}

        def last_writer(name: str, before: int) -> int | None:
            # an in-place write (`x.index_add_(...)`, `x += y`) changes the value as much as a rebinding
            for f in reversed(facts[:before]):
                if name in f.stores or name in f.mutates or name in f.may_write:
                    return f.index
            return None

        # A seed statement depends on the main path only through what it reads outside its side
        # calls: `h = h + self.shared_experts(x)` (h is routed output: the join, hoist the call) vs
        # `s = self.shared_experts(w)` (w may come from the router: then the fork simply follows it).
        depends_on_main: dict[int, bool] = {}
        for f in facts:
            dep = f.index not in seed_idx and bool(f.self_calls)
            # a seed statement that returns, or also runs the base class's work (`return
            # self.shared_experts(x) + super().forward(x)`), is a join: its side call is hoisted
            dep = dep or (f.index in seed_idx and (f.exits or _calls_super(f.node)))
            loads = _outer_loads(f.node, self.is_seed) if f.index in seed_idx else f.loads
            for name in loads:
                d = last_writer(name, f.index)
                if d is not None and depends_on_main[d]:
                    dep = True
            depends_on_main[f.index] = dep
        return depends_on_main

    def _side_statements(self, seeds: list[StatementFacts], depends_on_main: dict[int, bool]) -> set[int]:
        """The indices of the whole statements that move: the seed statements that need no main
        work, with their glue, the buffers made for them and the defaults of their outputs."""
        facts = self.facts
        # Glue around side calls (`mul_out = act_out * up_out` in a flattened expert, a gate's sigmoid)
        # belongs to the side branch: it reads side results and no main-path value.
        pure = {f.index for f in seeds if not depends_on_main[f.index]}
        changed = True
        while changed and pure:
            changed = False
            side_stores = {name for i in pure for name in facts[i].stores}
            for f in facts[min(pure) :]:
                if (
                    f.index not in pure
                    and isinstance(f.node, cst.SimpleStatementLine)
                    and not depends_on_main[f.index]
                    and not f.exits
                    and not f.self_calls
                    and f.loads & side_stores
                ):
                    pure.add(f.index)
                    changed = True
        self._add_side_buffers(pure)
        return pure

    def _add_side_buffers(self, pure: set[int]) -> None:
        """Adds to `pure` the buffers and defaults made only for the side branch."""
        facts, guard = self.facts, self.guard
        # Buffers prepared only for the side branch (`buf = torch.empty_like(x)` before a recv) move
        # with it: no submodule call, no in-place write, and only side statements read the result.
        for f in facts:
            if f.index in pure or not pure or f.index > max(pure):
                continue
            # statements that see this very definition (not a later rewrite, such as a recv filling it)
            readers = [
                g
                for g in facts[f.index + 1 :]
                if any(self.reaching_def(n, g.index, set()) == f.index for n in f.stores & g.loads)
            ]
            if (
                _allocates(f.node)
                and f.stores
                and not f.self_calls
                and not f.mutates
                and not f.exits
                and readers
                and all(g.index in pure for g in readers)
            ):
                pure.add(f.index)
            # `shared = None` before `if self.shared_experts is not None: shared = ...`: the default
            # of a side output moves with it, when only the side branch sees it
            elif (
                (guard is None or f.index in guard.inside)  # a default before a guarded `if` stays: see the fork
                and _binds_constant(f.node)
                and all(g.index in pure for g in readers)
                and any(g.index in pure and f.stores <= g.stores for g in facts[f.index + 1 :])
            ):
                pure.add(f.index)

    def _side_outputs(self, whole: list[StatementFacts], side_idx: set[int]) -> tuple[list[str], list[str]]:
        """(every name the side stores, in definition order; the outputs: those read after the
        branch, at the join and later). Temporaries used only inside the branch stay on the side
        stream and need no guard."""
        facts = self.facts
        side_stores: list[str] = []
        for f in whole:
            side_stores.extend(n for n in sorted(f.stores) if n not in side_stores)
        read_after = (
            {name for f in facts[max(side_idx) + 1 :] if f.index not in side_idx for name in f.loads}
            if side_idx
            else set()
        )
        return side_stores, [n for n in side_stores if n in read_after]

    def _join(
        self, side_idx: set[int], impure: list[StatementFacts], outputs: list[str], whole: list[StatementFacts]
    ) -> int:
        """The join: first statement after the side statements that reads a side output, or the
        impure seed statement whose calls get hoisted; NoBranch when side work comes after it."""
        facts = self.facts
        join = None
        first_side = min(side_idx) if side_idx else None
        for f in facts:
            if f.index in side_idx or (first_side is not None and f.index < first_side):
                continue
            if f in impure or (
                f.loads & set(outputs)
                and any(self.reaching_def(n, f.index, set()) in side_idx for n in f.loads & set(outputs))
            ):
                join = f.index
                break
        if join is None:
            raise NoBranch("the side branch's result is never used in this function")
        if any(f.index > join for f in impure):
            raise NoBranch(
                f"line {facts[join].first_line} consumes the side branch before line "
                f"{[f for f in impure if f.index > join][0].first_line} calls it again"
            )
        if any(f.index > join for f in whole):
            late = [f for f in whole if f.index > join][0]
            raise NoBranch(f"line {late.first_line}: side work after the join point is not supported")
        return join

    def _side_hoists(self, join_fact: StatementFacts, impure: list[StatementFacts], taken: set[str]) -> list[Hoist]:
        """The side calls hoisted out of the join statement into temporaries (none when it is no
        seed statement)."""
        is_seed, positions = self.is_seed, self.positions
        hoists: list[Hoist] = []
        every_branch = (
            _every_branch_calls(join_fact.node, is_seed, self.func, self.facts, self.local_names)
            if join_fact in impure and isinstance(join_fact.node, cst.If)
            else None
        )
        if join_fact in impure and not isinstance(join_fact.node, cst.SimpleStatementLine) and every_branch is None:
            raise NoBranch(
                f"line {join_fact.first_line}: the side call is conditional inside the join "
                f"({type(join_fact.node).__name__}); hoisting it would run it unconditionally"
            )
        if every_branch is not None:
            # the same call in every branch of an `if` runs on every path: hoisted once, before the `if`
            call = every_branch[0]
            where = positions[call]
            hoists.append(
                Hoist(
                    call=call,
                    temp=_temp_name(dotted_name(call.func) or "side", taken),
                    source=cst.Module(body=[]).code_for_node(call),
                    first_line=where.start.line,
                    last_line=where.end.line,
                    also=tuple(every_branch[1:]),
                )
            )
        elif join_fact in impure:
            for call in _seed_calls(join_fact.node, is_seed):
                if id(call) in _conditional_calls(join_fact.node):
                    raise NoBranch(
                        f"line {join_fact.first_line}: the side call is conditional inside the join (a conditional "
                        "expression or `and`/`or`); hoisting it would run it unconditionally"
                    )
                where = positions[call]
                hoists.append(
                    Hoist(
                        call=call,
                        temp=_temp_name(dotted_name(call.func) or "side", taken),
                        source=cst.Module(body=[]).code_for_node(call),
                        first_line=where.start.line,
                        last_line=where.end.line,
                    )
                )
        return hoists

    def _side_inputs(
        self, whole: list[StatementFacts], hoists: list[Hoist], join: int
    ) -> tuple[list[_Unit], list[StatementFacts], list[str]]:
        """(the side's units in order, the facts of each hoisted call, the inputs: names the side
        reads that it does not define itself first)."""
        inputs: list[str] = []
        defined: set[str] = set()
        # a side `if` reads, as inputs, only what it does not store first itself (in order, per
        # branch), and what its calls read beyond its syntax (a nested function's free variables)
        units: list[_Unit] = [
            (
                f.index,
                _read_first(f.node) | (f.loads - node_facts(f.node).loads) if isinstance(f.node, cst.If) else f.loads,
                f.stores,
            )
            for f in whole
        ]
        hoist_facts = [node_facts(h.call, self.scope) for h in hoists]
        units += [(join, hf.loads, {h.temp}) for h, hf in zip(hoists, hoist_facts, strict=True)]
        for _, loads, stores in units:
            for name in sorted((loads & self.local_names) - defined):  # globals, builtins and None are no inputs
                if name not in inputs:
                    inputs.append(name)
            defined |= stores
        return units, hoist_facts, inputs

    def _fork_after_inputs(
        self,
        units: list[_Unit],
        inputs: list[str],
        side_idx: set[int],
        join: int,
        hoists: list[Hoist],
        side_stores: list[str],
    ) -> int:
        """The earliest fork where every input already holds the value the side reads, never
        before the docstring, an early exit or (guarded) what the `if`'s condition reads."""
        facts, guard = self.facts, self.guard
        fork = 1 if is_docstring(self.body[0]) else 0
        for index, loads, _ in units:
            for name in loads & set(inputs):
                d = self.reaching_def(name, index, side_idx)
                if d is None:
                    continue
                fork = max(fork, d + 1)  # after the input exists, even when the main path made it
        # An early exit before the side work (`if x.shape[0] == 0: return x`): the original never
        # runs the side work on that path, so the fork comes after it, never before.
        first_side = min([*side_idx, *([join] if hoists else [])])
        for f in facts[fork:first_side]:
            if f.exits and f.index not in side_idx:
                fork = f.index + 1
        if guard is not None:
            # the guarded fork evaluates the `if`'s condition: after every local it reads exists
            for name in guard.locals_read:
                d = self.reaching_def(name, guard.index, side_idx)
                if d is not None:
                    fork = max(fork, d + 1)
            # `shared = None` before the `if`: its default for when the condition is false; the
            # side branch may only rebind it after it ran
            for f in facts[fork : guard.index]:
                if _binds_constant(f.node) and f.stores & set(side_stores):
                    fork = f.index + 1
        return fork

    def _fork_after_writes(
        self, units: list[_Unit], groups: dict[str, frozenset], storage: Storage, side_idx: set[int], fork: int
    ) -> tuple[int, tuple[int, str, str] | None]:
        """The fork after every main-path write to a side input that came first in the original
        order (in place, through an alias, or by a callee msrewrite cannot see into), with
        (statement, name written, the side input) of the write that holds it back, if any."""
        pushed_by: tuple[int, str, str] | None = None
        for index, loads, _ in units:
            for name in sorted(loads & set(groups)):
                mine = storage.held(name, index)
                for g in self.facts[:index]:
                    if g.index not in side_idx and _writes(storage, g, mine) and g.index + 1 > fork:
                        fork = g.index + 1
                        known = storage.written(g, g.index, mine)
                        hit = known + storage.maybe_written(g, g.index, mine)
                        pushed_by = (g.index, _own_first(hit, name)[0] if hit else name, name)
                        if not known and hit:  # only a callee msrewrite cannot see into may write it
                            self.unseen_pushes[(g.index, pushed_by[1])] = unseen_writers(g, [pushed_by[1]], self.scope)
        return fork, pushed_by

    def _side_state(self, side: list[StatementFacts], side_calls: list[cst.Call], storage: Storage) -> _SideState:
        """The module state the side work reads (attribute paths in full) and rebinds."""
        reads = set().union(
            *(_state_read(f.node, self.scope, full=True) | _state_via_locals(f, f.index, storage) for f in side),
            *(_state_read(c, self.scope, full=True) for c in side_calls),
        )
        rebinds = {path: f for f in side for r in sorted(f.rebinds) for path in _state_paths(r, f.index, storage)}
        writes = {path: f for f in side for path in _state_written(f, storage)}
        return _SideState(reads, rebinds, writes)

    def _state_clash(self, g: StatementFacts, side: _SideState, storage: Storage) -> str:
        """Why main statement `g` and the side work must keep their order over module state, or
        "": the side rebinds an attribute `g` reads (`self.last_norm = out.norm()` in the shared
        expert, `self.shared_experts.last_norm` on the main path), or `g` rebinds one the side
        reads or rebinds (inside a callee too: its summary's rebinds, on the call's receiver).
        On a device the side stream may run before or after `g`, and the fork moves the side
        work's Python above `g`: a Python number (`self.calls += 1`) counts as much as a tensor."""
        reads = _state_read(g.node, self.scope, full=True) | _state_via_locals(g, g.index, storage)
        for path, f in side.rebinds.items():
            hit = next((q for q in sorted(reads) if _same_attribute(path, q)), None)
            if hit is not None:
                return (
                    f"line {f.first_line}: the side branch rebinds module state '{path}', which the main path "
                    f"reads between the fork and the join (line {g.first_line}: '{hit}')"
                )
        for r in sorted(g.rebinds):
            for path in sorted(_state_paths(r, g.index, storage)):
                hit = next((q for q in sorted(side.reads | set(side.rebinds)) if _same_attribute(path, q)), None)
                if hit is not None:
                    verb = "rebinds" if hit in side.rebinds else "reads"
                    return (
                        f"line {g.first_line} rebinds module state '{path}' while the side stream {verb} "
                        f"{'it' if hit == path else repr(hit)}"
                    )
        return ""

    def _fork_after_state(
        self,
        units: list[_Unit],
        side_idx: set[int],
        side: _SideState,
        storage: Storage,
        fork: int,
        pushed_by: tuple[int, str, str] | None,
    ) -> tuple[int, tuple[int, str, str] | None]:
        """The fork after every main statement that comes before the side work in the original
        order and uses module state the side work changes, or changes state the side uses (the
        router reads `self.shared_experts.calls`, which the shared expert counts up): issued above
        it, the side work would change what it sees, or see its change too early."""
        first_side = units[0][0] if units else fork
        for g in self.facts[fork:first_side]:
            if g.index not in side_idx and self._state_ordered(g, side, storage):
                fork, pushed_by = g.index + 1, (g.index, "state", "")
        return fork, pushed_by

    def _state_ordered(self, g: StatementFacts, side: _SideState, storage: Storage) -> bool:
        """Whether main statement `g` and the side work must keep their order over module state:
        a rebinding either reads (_state_clash), or a write in place of state the other uses."""
        written = _state_written(g, storage)
        reads = _state_read(g.node, self.scope, full=True) | _state_via_locals(g, g.index, storage)
        return bool(
            self._state_clash(g, side, storage)
            or any(_same_attribute(p, q) for p in written for q in side.reads | set(side.writes) | set(side.rebinds))
            or any(_same_attribute(p, q) for p in side.writes for q in reads)
        )

    def _check_join_state(self, join_fact: StatementFacts, hoists: list[Hoist], side: _SideState, storage: Storage):
        """Hoisting a side call out of the join statement runs it before the rest of that
        statement (`return h * self.shared_experts.calls + self.shared_experts(x)`): refused when
        the rest uses module state the side work changes, or changes state it uses."""
        seeds = {id(h.call) for h in hoists} | {id(c) for h in hoists for c in h.also}

        class _Strip(cst.CSTTransformer):
            def leave_Call(self, original, updated):
                return cst.Name("_ms_side_call") if id(original) in seeds else updated

        stripped = join_fact.node.visit(_Strip())
        assert isinstance(stripped, cst.BaseStatement)  # leave_Call never removes a node
        rest = dataclasses.replace(
            node_facts(stripped, self.scope), index=join_fact.index, node=stripped, first_line=join_fact.first_line
        )
        if self._state_ordered(rest, side, storage):
            line = join_fact.first_line
            clash = self._state_clash(rest, side, storage) or (
                f"line {line}: the join statement uses module state the side call changes, or changes state it uses"
            )
            raise NoBranch(f"{clash}; hoisting the side call out of line {line} would change their order")

    def _fork_after_barriers(
        self,
        units: list[_Unit],
        side_idx: set[int],
        hoists: list[Hoist],
        fork: int,
        pushed_by: tuple[int, str, str] | None,
    ) -> tuple[int, tuple[int, str, str] | None]:
        """The fork after every main statement that orders streams (`ev.wait()`,
        `stream.synchronize()`, `torch.npu.synchronize()`, a helper doing one, an unseen wait) and
        comes before a side unit in the original order: the side stream waits on the main stream
        only as far as the fork, so work started above a wait would not wait for what the wait
        orders (a copy on another stream, a gather). `pushed_by`: what held the fork back so far;
        (statement, "", "") when the last such wait holds it back."""
        for index, _, _ in units:
            for g in self.facts[:index]:
                if g.index not in side_idx and g.barrier and g.index + 1 > fork:
                    fork, pushed_by = g.index + 1, (g.index, "", "")
        if hoists and self.facts[units[-1][0]].barrier:
            # the hoisted call and a wait in the join statement itself: which ran first is the
            # statement's evaluation order, which the hoist would change
            join_fact = self.facts[units[-1][0]]
            own = node_facts(join_fact.node, self.scope, after_calls=frozenset(id(h.call) for h in hoists))
            if own.barrier:
                raise NoBranch(
                    f"line {join_fact.first_line}: the join statement also orders streams (a wait or synchronize); "
                    "msrewrite does not hoist the side call out of it"
                )
        return fork, pushed_by

    def _fork_after_anchors(self, fork: int, join: int, side_idx: set[int]) -> int:
        """The fork after every start anchor's definition."""
        for anchor in self.anchors:
            d = self.reaching_def(anchor, join, side_idx)
            if d is None:
                raise NoBranch(f"start anchor '{anchor}' is not assigned before the join")
            fork = max(fork, d + 1)
        return fork

    def _check_rebound_inputs(self, units: list[_Unit], inputs: list[str], side_idx: set[int], fork: int) -> None:
        """Refuses when an input is rebound between the fork and the side statement reading it."""
        for index, loads, _ in units:
            for name in loads & set(inputs):
                if self.reaching_def(name, index, side_idx) != self.reaching_def(name, fork, side_idx):
                    raise NoBranch(
                        f"'{name}' is rebound between the fork and the side statement at line "
                        f"{self.facts[index].first_line}"
                    )

    def _main_hoists(
        self, join: int, window: list[StatementFacts], side_stores: list[str], taken: set[str]
    ) -> tuple[list[Hoist], list[StatementFacts]]:
        """The main calls hoisted out of the join statement when the window has no main work of its
        own (see _join_main_hoists), with their facts placed at the join."""
        facts = self.facts
        main_hoists: list[Hoist] = []
        main_hoist_facts: list[StatementFacts] = []
        if join < len(facts) and not any(f.has_call and f.self_calls for f in window):
            # the only main work is inside the join statement: hoisted out of it (flag on only) when
            # that keeps Python's order of evaluation, else the reason why not
            main_hoists = _join_main_hoists(
                facts[join],
                set(side_stores),
                self.is_seed,
                self.positions,
                taken,
                self.local_names,
                self.phase_anchors is not None,
            )
            main_hoist_facts = [
                dataclasses.replace(
                    node_facts(h.call, self.scope), index=join, first_line=h.first_line, last_line=h.last_line
                )
                for h in main_hoists
            ]
        return main_hoists, main_hoist_facts

    def _check_window(
        self,
        window: list[StatementFacts],
        side_idx: set[int],
        fork: int,
        groups: dict[str, frozenset],
        storage: Storage,
        outputs: list[str],
        side_stores: list[str],
        side_unseen: Callable[[], list[_SideUnseen]],
    ) -> list[str]:
        """Refuses a main statement of the window (from the side's start to the join, main hoists
        included: they run right before the join) that leaves the function, writes a side input or
        uses a side name; returns the inputs to snapshot at the fork (--protect clone). A refusal
        for unseen callees names every one, the side branch's (`side_unseen()`) too."""
        protected: list[str] = []
        unseen_hits: list[_Unseen] = []  # writes msrewrite cannot rule out
        for f in window:
            if f.index in side_idx:
                continue
            if f.exits:
                leaves = "raise" if f.raises and not _returns(f.node) else "return"
                raise NoBranch(f"line {f.first_line} can {leaves} before the join")
            for name, group in groups.items():
                self._window_write(f, name, group, fork, storage, protected, unseen_hits)
            clash = (f.loads | f.stores) & (set(outputs) | set(side_stores))
            if clash:
                raise NoBranch(f"line {f.first_line} uses '{sorted(clash)[0]}' between the fork and the join")
        if unseen_hits:
            side = side_unseen()
            every = [c for _, callees, _ in unseen_hits for c in callees] + [c for _, cs, *_ in side for c in cs]
            raise NoBranch(
                _unseen_refusal(unseen_hits, side, self.protect),
                vouch=vouch_for(every),
                clone=not self.protect and not side,
            )
        return protected

    def _window_write(
        self,
        f: StatementFacts,
        name: str,
        group: frozenset,
        fork: int,
        storage: Storage,
        protected: list[str],
        unseen_hits: list[_Unseen],
    ) -> None:
        """A main statement's write to the storage of side input `name`: protected (a snapshot at
        the fork), noted when only an unseen callee may write it, or refused."""
        known = _own_first(storage.written(f, f.index, group), name)
        unseen = _own_first(storage.maybe_written(f, f.index, group), name)
        if not known and not unseen:
            return
        if self.protect and f.index >= fork:
            # a write after the side's reads in the original order: a snapshot at the fork
            # gives the side exactly what it read before
            if name not in protected:
                protected.append(name)
            if known:
                self.written_in_place.add(name)
            return
        if known:
            hint = "; pass --protect clone to snapshot it at the fork" if f.index >= fork else ""
            via = _alias_origin(storage, self.facts, known[0], group, f.index, self.scope) if known[0] != name else ""
            via = f" ('{known[0]}' {via.removeprefix(', which ').rstrip(',')})" if via else ""
            if known[0] != name and _state_path(known[0]) and group & ALL_STATE_TOKENS:
                # the side reads all of the module's state through a local (`bufs = list(self.buffers())`)
                via = _state_via(f, name, "self", self.facts, self.scope, binder_before=True)
            callee = _writing_callee(f.node, known[0], self.scope)
            overrides = (
                "" if callee.startswith("the @property") else ", with every override and patch of it in the file"
            )
            via += f" (inside {callee}{overrides})" if callee else ""
            pending = f.pending.get(known[0]) or f.pending.get(name)
            via += f" ({pending})" if pending else ""
            raise NoBranch(
                f"line {f.first_line} writes '{known[0]}' in place while the side stream reads it{via}{hint}",
                clone=bool(hint),
            )
        unseen_hits.append((f.first_line, unseen_writers(f, [unseen[0]], self.scope), unseen[0]))

    def _nothing_to_overlap(
        self, join: int, fork: int, pushed_by: tuple[int, str, str] | None, storage: Storage
    ) -> NoBranch:
        """The refusal when no main work runs between the fork and the join, with why if known."""
        facts = self.facts
        why = ""
        vouch: tuple[str, ...] = ()
        in_join = (
            [f"self.{c}" for c in facts[join].self_calls if not self.is_seed(c)] + _super_calls(facts[join].node)
            if join < len(facts)
            else []
        )
        if in_join:
            why = (
                f" (the main work, {', '.join(dict.fromkeys(in_join))}, is in the join statement at line "
                f"{facts[join].first_line} itself; msrewrite does not split it out of that statement)"
            )
        elif pushed_by is not None and pushed_by[0] + 1 == fork:
            at, written, name = pushed_by
            line = facts[at].first_line
            if written == "state":
                why = (
                    f" (the fork waits for line {line}, which uses module state the side work changes, or changes "
                    "state it uses: the side work must not move above it)"
                )
            elif not written:
                why = (
                    f" (the fork waits for line {line}, which orders streams (a wait or synchronize): "
                    "the side work must not start before it)"
                )
            else:
                unseen = self.unseen_pushes.get((at, written))
                # "writes" only when proved; a callee msrewrite cannot see into only "may write"
                writes = f"where {_named(unseen, MAX_DESCRIBED)} may write" if unseen else "which writes"
                if written == name:
                    why = f" (the fork waits for line {line}, {writes} '{name}' before the side work reads it"
                else:
                    via = _alias_origin(
                        storage, facts, name, storage.held(written, at) - {("free", written)}, at, self.scope
                    )
                    why = (
                        f" (the fork waits for line {line}, {writes} '{written}' before the side work reads "
                        f"'{name}'{via.rstrip(',')}"
                    )
                if unseen:
                    vouch = vouch_for(unseen)
                    why += f"; pass {_vouch_options(unseen)} if {'it does' if len(unseen) == 1 else 'they do'} not"
                why += ")"
        # the fork pushed by a callee that may write: vouching for it may widen the window; else
        # vouching only ever moves the fork earlier, and no main work is there to overlap either way
        return NoBranch(
            f"no main-path work between the fork and the join: nothing to overlap{why}",
            vouch=vouch,
            structural=not vouch and not (pushed_by is not None and pushed_by[0] + 1 == fork),
        )

    def _check_side_writes(
        self,
        whole: list[StatementFacts],
        hoist_facts: list[StatementFacts],
        join: int,
        main: list[StatementFacts],
        storage: Storage,
        every_input: frozenset,
    ) -> None:
        """Refuses a side write (in place, or by a callee msrewrite cannot see into) to an input
        that a main statement of the window (`main`) still reads."""
        known, unseen = self._side_writes(whole, hoist_facts, join, main, storage, every_input)
        if known is not None and not unseen:  # the statements with unseen callees come before it
            line, name, reader = known
            pending = next((f.pending[name] for f in whole if f.first_line == line and name in f.pending), None)
            raise NoBranch(
                f"line {line}: the side branch writes its input '{name}' in place, which line "
                f"{reader} on the main path reads" + (f" ({pending})" if pending else "")
            )
        if unseen:
            # every side statement's: vouching for the first one's callees alone would only
            # move the refusal to the next
            line, callees, name, reader = unseen[0]
            every = [c for _, cs, *_ in unseen for c in cs]
            others = "".join(f"; line {ln}: {_named(cs, 1)} may write '{n}' too" for ln, cs, n, _ in unseen[1:])
            raise NoBranch(
                f"line {line}: {_named(callees, MAX_DESCRIBED)} may write its input '{name}', which the main path still "
                f"reads (line {reader}){others}; a snapshot cannot help here; pass {_vouch_options(every)} if "
                f"{'it does' if len(every) == 1 else 'they do'} not",
                vouch=vouch_for(every),
            )

    def _check_module_state(
        self, side: list[StatementFacts], side_calls: list[cst.Call], main: list[StatementFacts], storage: Storage
    ) -> None:
        """Refuses when the main path, between the side's start and the join, writes module state
        (`self.scale.mul_(2)`, a write through a view of it, `self.x = ...`) that the side work
        reads or writes, or the side work writes state the main path reads there: on a device the
        side stream may run before or after that write. Side inputs are checked by storage; module
        state is read by name (`self.<attr>`), so it is checked by attribute."""
        self._check_globals(side, main)
        scope = self.scope
        side_reads = set().union(
            *(_state_read(f.node, scope) for f in side), *(_state_read(c, scope) for c in side_calls)
        )
        side_writes = {path: (f, name) for f in side for path, name in _state_written(f, storage).items()}
        side_may = {path: (f, hit) for f in side for path, hit in _state_may_written(f, storage).items()}
        for g in main:
            _check_unseen_state_writes(g, side_reads | set(side_writes))
            for path, name in _state_written(g, storage).items():
                hit = next((q for q in sorted(side_reads | set(side_writes)) if _same_state(path, q)), None)
                if hit is not None:
                    via = _state_via(g, name, path, self.facts, scope)
                    if not via and path == "self":  # a method of the block: name it
                        callee = _writing_callee(g.node, "self", scope)
                        via = f" (inside {callee})" if callee else ""
                    why = ""
                    if hit == "self" and hit in side_reads:  # which read reaches all of it
                        props = sorted(set().union(*(_properties_read(f.node, scope) for f in side)))
                        why = f" (the @property {props[0]}, whose getter may read any of it)" if props else ""
                    raise NoBranch(
                        f"line {g.first_line} writes module state '{path}'{via} while the side stream "
                        f"{'writes' if hit not in side_reads else 'reads'} {'it' if hit == path else repr(hit)}{why}"
                    )
            for path, (name, why) in _state_may_written(g, storage).items():
                hit = next((q for q in sorted(side_reads | set(side_writes)) if _same_state(path, q)), None)
                if hit is not None:
                    via = _state_via(g, name, path, self.facts, scope) if name != path else ""
                    raise NoBranch(
                        f"line {g.first_line}: {why} may write module state '{path}'{via}, which the side stream "
                        f"{'writes' if hit not in side_reads else 'reads'}"
                        f"{'' if hit == path else ' (' + repr(hit) + ')'}; msrewrite cannot see into it; pass "
                        f"{_vouch_options([why])} if it does not",
                        vouch=vouch_for([why]),
                    )
            reads = _state_read(g.node, scope)
            for path, (f, (name, why)) in side_may.items():
                hit = next((q for q in sorted(reads) if _same_state(path, q)), None)
                if hit is not None:
                    via = _state_via(f, name, path, self.facts, scope) if name != path else ""
                    raise NoBranch(
                        f"line {f.first_line}: on the side branch {why} may write module state '{path}'{via}, which "
                        f"the main path reads between the fork and the join (line {g.first_line}: '{hit}'); "
                        f"msrewrite cannot see into it; pass {_vouch_options([why])} if it does not",
                        vouch=vouch_for([why]),
                    )
            for path, (f, name) in side_writes.items():
                hit = next((q for q in sorted(reads) if _same_state(path, q)), None)
                if hit is not None:
                    via = _state_via(f, name, path, self.facts, scope)
                    raise NoBranch(
                        f"line {f.first_line}: the side branch writes module state '{path}'{via}, which the main "
                        f"path reads between the fork and the join (line {g.first_line}: '{hit}')"
                    )

    def _check_globals(self, side: list[StatementFacts], main: list[StatementFacts]) -> None:
        """Refuses a module-level name (`_BUF`, a cache table) written in place on either side of
        the fork between the side's start and the join, itself or inside a callee: which globals
        a callee reads is not tracked, so the other side may read it while it is written. The
        module's imported modules, classes and functions are not tensors."""
        local = self.local_names | {"self"} | self.scope.module_names | BUILTIN_NAMES
        for where, facts in (("the main path", main), ("the side branch", side)):
            for f in facts:
                written = sorted(n for n in f.mutates if n.split(".")[0] not in local)
                if written:
                    other = "the side work" if where == "the main path" else "the main path"
                    raise NoBranch(
                        f"line {f.first_line}: {where} writes the module-level '{written[0]}' in place between the "
                        f"fork and the join; {other} may read it (msrewrite does not track which module-level "
                        "names a callee reads)"
                    )

    def _side_writes(
        self,
        whole: list[StatementFacts],
        hoist_facts: list[StatementFacts],
        join: int,
        main: list[StatementFacts],
        storage: Storage,
        every_input: frozenset,
    ) -> tuple[tuple[int, str, int] | None, list[_SideUnseen]]:
        """Side writes to an input a main statement of the window (`main`) still reads: the first
        in-place one (line, name, the reader's line), and before it, each side statement's unseen
        callees that may write such an input (line, callees, name, the reader's line)."""
        facts = self.facts

        def main_reader(name: str, at: int) -> StatementFacts | None:
            """The first main statement between the fork and the join that reads the storage `name`
            holds at `at`: a side write to it races with that read. A copy only the side reads
            (`identity = h.clone()`) may be written there freely."""
            written = storage._around(name, at) & every_input
            return next((g for g in main if any(storage._around(n, g.index) & written for n in g.loads)), None)

        unseen_hits: list[_SideUnseen] = []
        for f, at in [*((f, f.index) for f in whole), *((hf, join) for hf in hoist_facts)]:
            line = f.first_line or facts[join].first_line
            bad = [n for n in storage.written(f, at, every_input) if main_reader(n, at) is not None]
            if bad:
                reader = main_reader(bad[0], at)
                assert reader is not None  # found just above
                return (line, bad[0], reader.first_line), unseen_hits
            unseen = [n for n in storage.maybe_written(f, at, every_input) if main_reader(n, at) is not None]
            if unseen:
                reader = main_reader(unseen[0], at)
                assert reader is not None  # found just above
                unseen_hits.append((line, unseen_writers(f, [unseen[0]], self.scope), unseen[0], reader.first_line))
        return None, unseen_hits


@record(frozen=True)
class _OrderedWork:
    """Work whose order against the main path's own is part of the result: random draws, whose
    order decides every value drawn after them, or collectives, whose order on a communicator
    every rank must agree on."""

    verb: str  # "draws random numbers"
    nouns: str  # "the draws"
    may: str  # what a callee msrewrite cannot see into may do
    both: str  # what moving the side work does when both paths hold it
    unseen: str  # the same when one path reaches a callee msrewrite cannot see into
    holds: Callable[[CallEffect], bool]


RNG = _OrderedWork(
    "draws random numbers",
    "the draws",
    "may draw too",
    "on a side stream the order of the draws changes, and with it every random value in train mode",
    "their order may change in train mode",
    lambda effect: effect.rng,
)
COLLECTIVES = _OrderedWork(
    "runs a collective",
    "the collectives",
    "may run one too",
    "on two streams nothing fixes their order any more (a graph compiler or a second communicator may "
    "run either first), and ranks that disagree on it hang",
    "their order may change, and ranks that disagree on it hang",
    lambda effect: effect.collective,
)


def _ordered_calls(
    node: cst.CSTNode, scope: Scope, kind: _OrderedWork, skip: tuple[cst.Call, ...] = ()
) -> tuple[list[str], list[str]]:
    """(the calls in `node` that do `kind`'s work, the callees not seen into that may), outside
    the calls in `skip` (hoisted side calls inside a join statement)."""
    found: list[str] = []
    unseen: list[str] = []

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> bool:
            if any(call is s for s in skip):
                return False
            effect = scope.effect_of(call)
            if kind.holds(effect):
                found.append(source(call.func))
            unseen.extend(u for u in [*effect.unknown, *effect.unseen_work] if u not in unseen)
            return True

        def visit_FunctionDef(self, _n: cst.FunctionDef) -> bool:
            return False

        def visit_Lambda(self, _n: cst.Lambda) -> bool:
            return False

    node.visit(_Calls())
    return list(dict.fromkeys(found)), unseen


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _reordered(
    kind: _OrderedWork,
    facts,
    whole,
    hoists,
    start: int,
    join: int,
    side_idx: set[int],
    scope: Scope,
    main_hoists: bool = False,
) -> tuple[str, str]:
    """(Why the side work's `kind` of work changes order against the main path's, or "";
    the callee not seen into that the reason rests on, or "").

    The side work is issued at the fork, and a device (a graph compiler too) may run it anywhere
    up to the join: when the side work holds such work and so do the main statements of that
    window (from the fork, or from the side's own place if that is earlier, to the join; with
    hoisted calls, the rest of the join statement too), it may come in another order. A callee
    msrewrite cannot see into may hold it too. Dropout with p=0, or used only in eval, cannot be
    told apart here: it counts."""
    side_found: list[str] = []
    side_unseen: list[str] = []
    side_line = 0
    for line, node in [*((f.first_line, f.node) for f in whole), *((h.first_line, h.call) for h in hoists)]:
        found, unseen = _ordered_calls(node, scope, kind)
        side_line = side_line or (line if found else 0)
        side_found += [d for d in found if d not in side_found]
        side_unseen += [u for u in unseen if u not in side_unseen]
    if not side_found and not side_unseen:
        return "", ""  # the common case: nothing on the side holds such work
    main: list[tuple[int, list[str], list[str]]] = []
    for f in facts[start:join]:
        if f.index not in side_idx:
            main.append((f.first_line, *_ordered_calls(f.node, scope, kind)))
    if hoists or main_hoists:  # the rest of the join statement (main calls hoisted out of it too)
        skip = tuple(c for h in hoists for c in (h.call, *h.also))
        main.append((facts[join].first_line, *_ordered_calls(facts[join].node, scope, kind, skip)))
    main_found = next(((line, found) for line, found, _ in main if found), None)
    main_unseen = next(((line, unseen) for line, _, unseen in main if unseen), None)
    if side_found and main_found is not None:
        return (
            f"the side branch {kind.verb} (line {side_line}: {_few(side_found)}) and so does the main "
            f"path between the fork and the join (line {main_found[0]}: {_few(main_found[1])}): {kind.both}"
        ), ""
    if side_found and main_unseen is not None:
        return (
            f"the side branch {kind.verb} (line {side_line}: {_few(side_found)}) and the main path "
            f"between the fork and the join calls {main_unseen[1][0]} (line {main_unseen[0]}), which msrewrite "
            f"cannot see into and which {kind.may}: {kind.unseen}"
        ), main_unseen[1][0]
    if main_found is not None and side_unseen:
        return (
            f"the main path {kind.verb} between the fork and the join (line {main_found[0]}: "
            f"{_few(main_found[1])}) and the side branch calls {side_unseen[0]}, which msrewrite cannot "
            f"see into and which {kind.may}: {kind.unseen}"
        ), side_unseen[0]
    return "", ""


@record
class _SideState:
    """Module state the side work reads (attribute paths), rebinds and writes in place (path ->
    the side statement)."""

    reads: set[str]
    rebinds: dict[str, StatementFacts]
    writes: dict[str, StatementFacts]


def _same_attribute(a: str, b: str) -> bool:
    """Two attribute paths that may name the same state: equal, one inside the other, or `self` (all of it)."""
    return a == b or "self" in (a, b) or a.startswith(b + ".") or b.startswith(a + ".")


def _state_paths(path: str, at: int, storage: Storage) -> set[str]:
    """Module-state paths a dotted path names at statement `at`: `self.x.y` itself, or `m.y`
    for a local `m` bound to state (`m = self.shared_experts`); none for other objects."""
    root, dot, rest = path.partition(".")
    if root == "self":
        return {path}
    found = set()
    for kind, *held in storage.held(root, at) | storage.held(root, at + 1):
        base = held[-1] if kind in ("free", "param") else ""
        if base == "self" or base.startswith("self."):
            found.add(base + dot + rest)
    return found


def _state_via_locals(f: StatementFacts, at: int, storage: Storage) -> set[str]:
    """The module state statement `f` reads through locals bound to it (`m = self.shared_experts`)."""
    return {p for name in f.loads for p in _state_paths(name, at, storage)}


def _check_unseen_state_writes(g: StatementFacts, side_state: set[str]) -> None:
    """Refuses a main statement whose callee msrewrite cannot see into is handed module state
    the side work reads or writes (`fused_moe(self.shared_experts.w1, x)`): it may write it, and a
    snapshot of the side's inputs does not copy module state."""
    for name, callee in sorted(g.may_write.items()):
        if not name.startswith("self."):
            continue
        path = _state_key(name)
        hit = next((q for q in sorted(side_state) if _same_state(path, q)), None)
        if hit is not None:
            raise NoBranch(
                f"line {g.first_line}: {callee} may write module state '{path}', which the side stream "
                f"{'uses' if hit == path else f'uses ({hit!r})'}; a snapshot cannot help here; pass "
                f"{_vouch_options([callee])} if it does not",
                vouch=vouch_for([callee]),
            )


def _state_key(path: str) -> str:
    """Module state at the grain storage tracks it: `self.experts` for `self.experts.w1.weight`."""
    return ".".join(path.split(".")[:2])


def _same_state(a: str, b: str) -> bool:
    return a == b or "self" in (a, b)


def _state_read(node: cst.CSTNode, scope: Scope, full: bool = False) -> set[str]:
    """The module state a statement (or call) reads: each `self.<attr>` it names (with `full`,
    the whole attribute chain: `self.shared_experts.calls`), and all of `self` where it calls one
    of the class's own methods, reads a @property, or hands `self` on (what those read is not
    tracked)."""
    found: set[str] = set()
    called: set[int] = set()
    attrs = scope.state_attrs

    class _Reads(Visitor):
        def visit_Attribute(self, node: cst.Attribute) -> bool:
            chain = self_chain(node)
            if chain is None:
                return True  # not on `self`, or self.experts[i].w: the inner self.experts is found below
            if full and id(node) in called and chain.count(".") > 1:
                chain = chain.rpartition(".")[0]  # self.shared_experts.reset(): its object's state
            attr = chain.split(".")[1]
            # a @property's getter reads what it likes (as a method does); `self._buffers` is all of it
            whole = attr in scope.properties or attr in MODULE_STATE_TABLES
            found.add("self" if whole else chain if full else _state_key(chain))
            return False

        def visit_Call(self, call: cst.Call) -> None:
            func = call.func
            called.add(id(func))
            if (
                isinstance(func, cst.Attribute)
                and isinstance(func.value, cst.Name)
                and func.value.value == "self"
                and (attrs is None or func.attr.value not in attrs)
            ):
                # self.helper(...): a method; what its body names, or all of the object's state
                reads = scope.method_reads(func.attr.value) if scope.method_reads is not None else None
                if reads is None:
                    found.add("self")
                else:
                    found.update(reads if full else {_state_key(r) for r in reads})
            if any(isinstance(a.value, cst.Name) and a.value.value == "self" for a in call.args):
                found.add("self")

        def visit_FunctionDef(self, _n: cst.FunctionDef) -> bool:
            return False

    node.visit(_Reads())
    return found


def _state_via(
    f: StatementFacts, name: str, path: str, facts: list[StatementFacts], scope: Scope, binder_before: bool = False
) -> str:
    """How statement `f` reaches the module state `path` it writes through `name`, for a refusal:
    " (through 'p', from self.parameters())", " (through self.get_buffer('bias'))",
    " (in self._update(...))", " (through 'view')", or "". `binder_before`: `name` was bound
    before `f` (a side input)."""
    from msrewrite.analyze.torch_effects import torch_call_effect

    local = name.isidentifier() and name != path
    if local:  # where the local came to hold the state: this statement, or the last one binding it
        before = list(reversed(facts[: f.index]))
        binder = next((h for h in ([] if binder_before else [f]) + before if any(t == name for _, t in h.links)), f)
        accessor = _state_accessor_call(binder.node, scope)
        return f" (through '{name}', from {accessor})" if accessor else f" (through '{name}')"
    if name != path:
        return f" (through '{name}')"  # a @property's getter: its own words
    writer = next(
        (c for c in all_calls(f.node) if isinstance(c.func, cst.Attribute) and c.func.attr.value in STATE_WRITERS), None
    )
    if writer is not None and any(
        _state_key(r) == path for w in scope.effect_of(writer).writes for r in alias_roots(w, scope)
    ):
        return f" (in {source(writer.func)}(...))"  # self.load_state_dict(sd), self.sub.to(...)
    accessor = _state_accessor_call(f.node, scope)
    if accessor:
        return f" (through {accessor})"
    table = next((t for t in sorted(MODULE_STATE_TABLES) if f"self.{t}" in _self_attributes(f.node)), None)
    if table is not None:
        return f" (through self.{table})"
    for call in all_calls(f.node):  # a method of the class or a function that writes it, or returns it
        func = call.func
        method = isinstance(func, cst.Attribute) and (
            scope.state_attrs is None or func.attr.value not in scope.state_attrs
        )
        function = isinstance(func, cst.Name) and torch_call_effect(call) is None
        if (method and dotted_name(func.value) == "self") or function:  # type: ignore[attr-defined]
            written = {r for w in scope.effect_of(call).writes for r in alias_roots(w, scope)}
            if any(_state_key(r) == path for r in written):
                return f" (in {source(func)}(...))"
            if any(_state_key(r) == path for r in alias_roots(call, scope)):
                return f" (through {source(func)}(...), which returns it)"
    for prop in sorted(_properties_read(f.node, scope)):
        if any(_state_key(r) == path for r in alias_roots(cst.parse_expression(prop), scope)):
            return f" (through the @property {prop})"
    return ""


def _state_path(name: str) -> bool:
    return name == "self" or name.startswith("self.")


def _properties_read(node: cst.CSTNode, scope: Scope) -> set[str]:
    """`self.<name>` attributes `node` reads that the class defines as a @property."""
    return {a for a in _self_attributes(node) if a.partition(".")[2] in scope.properties}


def _self_attributes(node: cst.CSTNode) -> set[str]:
    """Every `self.<name>` `node` mentions."""
    found: set[str] = set()

    class _Reads(Visitor):
        def visit_Attribute(self, attr: cst.Attribute) -> None:
            if _is_self(attr.value):
                found.add(f"self.{attr.attr.value}")

    node.visit(_Reads())
    return found


def _is_self(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "self"


def _state_accessor_call(node: cst.CSTNode, scope: Scope) -> str:
    """The first nn.Module state accessor called in `node` (`self.parameters()`), as written; ""."""
    for call in all_calls(node):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in STATE_ACCESSORS:
            if any(r == "self" or r.startswith("self.") for r in alias_roots(call, scope)):
                text = " ".join(source(call).split())
                return text if len(text) <= 50 else text[:47] + "..."
    return ""


def _state_may_written(f: StatementFacts, storage: Storage) -> dict[str, tuple[str, str]]:
    """Module state a callee msrewrite cannot see into may write in `f` because it is handed it
    (`torch._foreach_mul_(list(self.parameters()), 0.9)`, `kernel(self.bias)`): `self.<attr>` ->
    (the name it is handed through, the callee)."""
    out: dict[str, tuple[str, str]] = {}
    for name, why in sorted(f.may_write.items()):
        if name in f.mutates:
            continue  # a definite write (a @property's getter): _state_written names it
        if name == "self" or name.startswith("self."):
            out.setdefault(_state_key(name), (name, why))
        for kind, *rest in storage._around(name, f.index):
            held = rest[-1] if kind in ("free", "param") else ""
            if held == "self" or held.startswith("self."):
                out.setdefault(_state_key(held), (name, why))
    return out


def _state_written(f: StatementFacts, storage: Storage) -> dict[str, str]:
    """Module state `f` writes: `self.<attr>` -> the name it writes it through (itself, a view of
    it, or `self` handed to a callee that writes it); rebinding `self.<attr>` counts too."""
    out: dict[str, str] = {}
    for name in sorted(f.mutates):
        if name == "self" and "(a @property" in f.may_write.get("self", ""):  # defuse._property_read
            out.setdefault("self", f.may_write["self"])
        elif name == "self" or name.startswith("self."):
            out.setdefault(_state_key(name), name)
        for kind, *rest in storage.write_reach(f, name, f.index):
            held = rest[-1] if kind in ("free", "param") else ""
            if held == "self" or held.startswith("self."):
                out.setdefault(_state_key(held), name)
    for name in sorted(f.self_stores):
        out.setdefault(_state_key(name), name)
    return out


def _check_order(*window) -> str:
    """Refuses side work whose collectives change order against the main path's; returns why its
    random draws do, or "" (the reviewer may allow that: --allow-rng-reorder)."""
    collectives, unseen = _reordered(COLLECTIVES, *window)
    if collectives:
        vouch = f", or pass {_vouch_options([unseen])} if it runs none" if unseen else ""
        raise NoBranch(
            f"{collectives}; msrewrite keeps collectives in the program's order{vouch}",
            vouch=vouch_for([unseen]) if unseen else (),
        )
    return _reordered(RNG, *window)[0]


def _side_only_if(f: StatementFacts, func: cst.FunctionDef, facts: list[StatementFacts]) -> bool:
    """`if c: s = self.shared_experts(h) else: s = self.dense_mlp(h)`: the other branch is side
    work too when the `if` as a whole writes nothing in place, assigns no `self.` state, reaches no
    callee msrewrite cannot see into and holds no collective, RNG or stream code, and every test
    of it (and its `elif`s) is invariant: then the whole `if` moves to the side stream."""
    if f.mutates or f.may_write or f.unknown_callees or f.unseen_work or f.collective or f.rng or f.stream:
        return False
    node = f.node
    assert isinstance(node, cst.If)
    if assigned_self_attrs(
        cst.FunctionDef(name=cst.Name("_"), params=cst.Parameters(), body=cst.IndentedBlock(body=[node]))
    ):
        return False
    params = {p.name.value for p in (*func.params.params, *func.params.kwonly_params, *func.params.posonly_params)}
    local_names = params | {name for g in facts for name in g.stores}
    test: cst.If | None = node
    while test is not None:
        if invariance_problem(test.test, func, facts, local_names)[0]:
            return False
        test = test.orelse if isinstance(test.orelse, cst.If) else None
    return True


def _check_guard(guard: Guard, facts, fork: int, join: int, side_idx: set[int], block_len: int) -> None:
    """The split is right only if the side work stays in the `if`'s block, the fork comes before
    the `if`, and the condition reads the same at the fork as at the `if` (and at a join after it)."""
    inside = range(guard.index, guard.index + block_len)
    outside = sorted(i for i in side_idx if i not in inside)
    if outside:
        raise NoBranch(
            f"line {facts[outside[0]].first_line}: side work outside the `if` at line {guard.line} "
            "would run even when its condition is false"
        )
    if fork > guard.index:
        raise NoBranch(
            f"the side branch's inputs are computed inside the `if` at line {guard.line}: nothing to overlap before it"
        )
    # the condition is evaluated at the fork, at the `if`, and again at a join placed after it
    until = guard.index if join in inside else join
    for f in facts[fork:until]:
        changed = (f.stores | f.mutates) & guard.locals_read
        if changed:
            raise NoBranch(
                f"line {f.first_line} changes '{sorted(changed)[0]}', which the `if` at line {guard.line} "
                "reads, between the fork and the `if`"
            )
    for i in side_idx:
        changed = facts[i].stores & guard.locals_read
        if changed:
            raise NoBranch(
                f"line {facts[i].first_line}: the side branch rebinds '{sorted(changed)[0]}', which its `if` reads"
            )


def _allocates(stmt: cst.BaseStatement) -> bool:
    """`name = <call>`: a buffer made for the side branch (torch.empty_like(x), x.new_empty(...))."""
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Assign)
        and isinstance(stmt.body[0].value, cst.Call)
    )


def _binds_constant(stmt: cst.BaseStatement) -> bool:
    """`name = None` (or another literal): a default, not work."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign)):
        return False
    assign = stmt.body[0]
    value = assign.value
    return (
        len(assign.targets) == 1
        and isinstance(assign.targets[0].target, cst.Name)
        and (
            isinstance(value, (cst.Integer, cst.Float, cst.SimpleString))
            or (isinstance(value, cst.Name) and value.value in ("None", "True", "False"))
        )
    )


def _outer_loads(node: cst.CSTNode, is_seed: SeedPredicate) -> set[str]:
    """Names a statement reads outside its side calls (and their arguments)."""
    seeds = set(map(id, _seed_calls(node, is_seed)))

    class _Strip(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            return cst.Name("_ms_side_call") if id(original) in seeds else updated

    stripped = node.visit(_Strip())
    assert isinstance(stripped, cst.CSTNode)  # leave_Call never removes a node
    return node_facts(stripped).loads - {"_ms_side_call"}


def derive_phase_anchors(facts: list[StatementFacts], fork: int, join: int, side_idx: set[int]) -> list[str]:
    """Anchors when none are given: the results of the main-path steps before the last one, at most
    two, so the side phases start after dispatch-like and compute-like steps and the last phase
    overlaps the final step (combine)."""
    steps = [f for f in facts[fork:join] if f.index not in side_idx and f.self_calls]
    anchors = []
    for f in steps[max(0, len(steps) - 3) : len(steps) - 1]:
        names = sorted(n for n in f.stores if n != "_")
        if names:
            anchors.append(names[-1] if len(names) > 1 else names[0])
    return anchors


def _assign_phases(func, facts, whole, anchors, fork, join, side_idx, reaching_def, inputs):
    """(phase of each side statement, the inner phases of a side `if` split over several): its
    depth in the side branch, capped at the number of anchors.

    Depth 0 reads only the fork's inputs, depth d reads a depth d-1 result: projections first,
    activations next, the rest last (the SGLang / cann-recipes three-phase split).
    """
    anchor_defs = _phase_anchor_defs(facts, anchors, fork, join, side_idx, reaching_def)
    units = _phase_units(func, facts, whole, fork, join)
    depth: list[int] = []
    for u, (_, _, loads, _, _) in enumerate(units):
        # every earlier side definition may reach it (one inside an `if` may not have run)
        sources = [depth[v] for v in range(u) if units[v][3] & loads]
        depth.append(1 + max(sources, default=-1))
    phase = [min(d, len(anchors)) for d in depth]
    # A later statement that rebinds or writes what an earlier one reads or writes never runs in
    # an earlier phase than it (the side stream runs the phases in order, each in program order).
    for u, (_, _, _, stores, _) in enumerate(units):
        for v in range(u):
            if stores & (units[v][2] | units[v][3]):
                phase[u] = max(phase[u], phase[v])
    for u, (_, _, loads, _, line) in enumerate(units):
        if phase[u] == 0:
            continue
        at = anchor_defs[phase[u] - 1] + 1
        for name in loads & inputs:
            if reaching_def(name, at, side_idx) != reaching_def(name, fork, side_idx):
                raise NoBranch(f"'{name}' changes between the fork and phase {phase[u]} at line {line}")
    phases: dict[int, int] = {}
    inner_phases: dict[int, tuple[int, ...]] = {}
    for u, (i, k, _, _, _) in enumerate(units):
        phases[i] = min(phases.get(i, phase[u]), phase[u])
        if k >= 0:
            inner_phases[i] = (*inner_phases.get(i, ()), phase[u])
    inner_phases = {i: p for i, p in inner_phases.items() if len(set(p)) > 1}  # one phase: the whole `if`
    return phases, inner_phases


def _phase_anchor_defs(
    facts: list[StatementFacts],
    anchors: list[str],
    fork: int,
    join: int,
    side_idx: set[int],
    reaching_def: Callable[[str, int, set[int]], int | None],
) -> list[int]:
    """The statement defining each phase anchor, checked: inside the window, in program order."""
    anchor_defs: list[int] = []
    for anchor in anchors:
        d = reaching_def(anchor, join, side_idx)
        if d is None:
            raise NoBranch(f"phase anchor '{anchor}' is not assigned before the join")
        if d < fork:
            raise NoBranch(
                f"phase anchor '{anchor}' is ready before the side branch starts (line {facts[d].first_line})"
            )
        if anchor_defs and d <= anchor_defs[-1]:
            raise NoBranch(f"phase anchors must come in program order ('{anchor}' is out of order)")
        anchor_defs.append(d)
    return anchor_defs


def _phase_units(
    func: cst.FunctionDef, facts: list[StatementFacts], whole: list[StatementFacts], fork: int, join: int
) -> list[tuple[int, int, set[str], set[str], int]]:
    """Units in program order: whole statements, and the statements inside a side `if` that can be
    split over phases (each phase issues the `if` again with its own statements only), each as
    (statement, k or -1, loads, stores, line)."""
    splittable = {f.index: lines for f in whole if (lines := _phase_split_lines(f, func, facts, fork, join))}
    units: list[tuple[int, int, set[str], set[str], int]] = []
    for f in sorted(whole, key=lambda f: f.index):
        if f.index in splittable:
            for k, line in enumerate(splittable[f.index]):
                inner = node_facts(line)
                units.append((f.index, k, inner.loads | inner.mutates, inner.stores | inner.mutates, f.first_line))
        else:
            units.append((f.index, -1, f.loads | f.mutates, f.stores | f.mutates, f.first_line))
    return units


def _phase_split_lines(f: StatementFacts, func: cst.FunctionDef, facts: list[StatementFacts], fork: int, join: int):
    """The simple statements of a side `if` (in source order) when its phases may be split: `if`s
    without `else`/`elif`, blocks of single-statement lines and such `if`s, every test invariant,
    reading no local that anything between the fork and the join rebinds or writes (each phase
    tests it again). None otherwise: the `if` runs whole in one phase."""
    if not isinstance(f.node, cst.If):
        return None
    params = {p.name.value for p in (*func.params.params, *func.params.kwonly_params, *func.params.posonly_params)}
    local_names = params | {name for g in facts for name in g.stores}
    changed = {name for g in facts[fork:join] for name in g.stores | g.mutates}
    lines: list[cst.SimpleStatementLine] = []

    def walk(node: cst.If) -> bool:
        if node.orelse is not None or not isinstance(node.body, cst.IndentedBlock):
            return False
        problem, read = invariance_problem(node.test, func, facts, local_names)
        if problem or read & changed:
            return False
        for stmt in node.body.body:
            if isinstance(stmt, cst.If):
                if not walk(stmt):
                    return False
            elif isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
                lines.append(stmt)
            else:
                return False
        return True

    return lines if walk(f.node) and len(lines) > 1 else None


def _writing_callee(node: cst.CSTNode, name: str, scope: Scope) -> str:
    """The first call in `node` that the file's summaries (not the torch table) say writes `name`:
    a method, helper or submodule, named so that a refusal says where the write is."""
    from msrewrite.analyze.torch_effects import torch_call_effect

    for call in all_calls(node):
        if torch_call_effect(call) is not None:
            continue
        if any(name in alias_roots(w, scope) for w in scope.effect_of(call).writes):
            return f"{dotted_name(call.func) or 'a call'}(...)"
    for prop in sorted(_properties_read(node, scope)):  # reading a @property runs its getter
        if any(
            name in alias_roots(w, scope) for w in scope.effect_of(cst.Call(func=cst.parse_expression(prop))).writes
        ):
            return f"the @property {prop}'s getter"
    return ""


def _writes(storage: Storage, f: StatementFacts, tokens: frozenset) -> bool:
    """Does the statement write (in place, or possibly through an unseen callee) that storage?"""
    return bool(storage.written(f, f.index, tokens) or storage.maybe_written(f, f.index, tokens))


def _returns(node: cst.CSTNode) -> bool:
    found = False

    class _Finder(Visitor):
        def visit_Return(self, _n: cst.Return) -> None:
            nonlocal found
            found = True

        def visit_FunctionDef(self, _n: cst.FunctionDef) -> bool:
            return False

    node.visit(_Finder())
    return found


# An unseen write on the main path: (line, the callees that may make it, the side input's name);
# on the side branch: also the line of the main statement that reads it.
_Unseen = tuple[int, list[str], str]
_SideUnseen = tuple[int, list[str], str, int]

# A refusal for unseen callees describes at most MAX_DESCRIBED of them (each is a chain through
# the layers read, often 100+ characters) and lists at most MAX_VOUCHED --assume-pure names: the
# line stays readable, and past a dozen callees vouching one by one is no review (SGLang's
# granitemoe needs six). Past either it says how many more.
MAX_DESCRIBED = 4
MAX_VOUCHED = 12


def _named(callees: list[str], room: int) -> str:
    """'A', 'A and B', 'A, B and 3 more unseen callees': one chain per layer that vouches for
    them (`_by_layer`), at most `room` (at least one) described."""
    lead = _by_layer(callees)
    shown = lead[: max(room, 1)]
    rest = len(callees) - len(shown)
    if rest:
        return f"{', '.join(shown)} and {rest} more unseen {'callee' if rest == 1 else 'callees'}"
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def _vouch_options(callees: list[str]) -> str:
    """The exact --assume-pure options that vouch for every callee (at most MAX_VOUCHED named)."""
    every = vouch_names(callees)
    names = [n for n in every if n]
    text = " ".join(f"--assume-pure {n}" for n in names[:MAX_VOUCHED])
    rest = len(names) - MAX_VOUCHED
    if rest > 0:
        text += f" (and {rest} more, not named here)"
    if len(names) < len(every):
        own = [_own_name(c) for c in callees]
        text += f" (no name --assume-pure takes vouches for {_named([c for c in callees if not _cover(c, own)], 1)})"
    return text


def _unseen_refusal(hits: list[_Unseen], side: list[_SideUnseen], protect: bool) -> str:
    """One refusal naming every unseen callee that may write a side input on the main path, and
    those of the side branch that may write an input the main path reads (a snapshot cannot help
    those), with the exact options that let the edit through. With `protect` on, the main path's
    hits are writes before the fork, which a snapshot taken there cannot help either."""
    clauses, room = [], MAX_DESCRIBED
    for i, (line, callees, name) in enumerate(hits):
        clauses.append(
            f"line {line}: {_named(callees, room)} may write '{name}'"
            + (" which the side stream reads" if i == 0 else " too")
        )
        room -= len(_by_layer(callees))
    main_callees = [c for _, callees, _ in hits for c in callees]
    side_callees = [c for _, callees, *_ in side for c in callees]
    if protect:
        if side:
            line, callees, name, reader = side[0]
            clauses.append(
                f"on the side branch, line {line}: {_named(callees, room)} may write its input '{name}', "
                f"which the main path reads (line {reader})"
            )
        return (
            "; ".join(clauses)
            + f"; a snapshot at the fork cannot help; pass {_vouch_options(main_callees + side_callees)}"
        )
    if not side:
        vouch = _vouch_options(main_callees)
        return "; ".join(clauses) + f"; pass --protect clone{'' if vouch.startswith(' (') else ' or '}{vouch}"
    line, callees, name, reader = side[0]
    clauses.append(
        f"on the side branch, line {line}: {_named(callees, room)} may write its input '{name}', "
        f"which the main path reads (line {reader})"
    )
    return (
        "; ".join(clauses) + f"; pass {_vouch_options(main_callees + side_callees)}, or --protect clone "
        f"{_vouch_options(side_callees)}"
    )


def vouch_names(callees: list[str]) -> list[str]:
    """The --assume-pure names that vouch for every callee, in order, each once: a chain's own
    name (`_own_name`), unless a layer further out in it is named for another chain already
    (`self.experts (FusedMoE) -> self.dispatcher.dispatch (...)` is covered by FusedMoE). A
    callee with no name --assume-pure takes (a Triton launch `kernel[grid]` called directly) gives ''."""
    own = list(dict.fromkeys(_own_name(c) for c in callees))
    return list(dict.fromkeys(_cover(c, own) for c in callees))


def _nameable(name: str) -> bool:
    """A name --assume-pure takes: a class, function or attribute, dotted (apply checks the same)."""
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _own_name(callee: str) -> str:
    """The name that vouches for one chain: the deepest layer class it names (vouch_name); in a
    chain of functions only that ends in a plain call, the function that makes it (`fused_moe ->
    BuildSpec (not visible ...)`: fused_moe, whose source a reviewer can read, not each call in it)."""
    parts = callee.split(" -> ")
    bare = (
        parts[-1].endswith(" (not visible to msrewrite)")
        and " (" not in parts[-1][: -len(" (not visible to msrewrite)")]
    )
    own_method = len(parts) == 2 and parts[0].startswith("self.")  # the analyzed class's helper: its call, not it
    if len(parts) > 1 and bare and not own_method and not any(_part_class(p) for p in parts):
        name = _link_name(parts[-2])
    else:
        name = vouch_name(callee)
    if not _nameable(name):  # `"".join`, `kernel[grid]`: the nearest link further out that has a name
        name = next((n for p in reversed(parts[:-1]) for n in (_part_class(p), _link_name(p)) if _nameable(n)), "")
    return name


def _link_name(part: str) -> str:
    """'shared_experts' for 'self.shared_experts (MLP)', 'fused_moe' for 'fused_moe'."""
    return part.partition(" (")[0].removeprefix("self.")


def _cover(callee: str, own: list[str]) -> str:
    """The name that vouches for `callee` among chains whose own names are `own`: its outermost
    link named there (by its class or its own name), else its own name."""
    for part in callee.split(" -> ")[:-1]:
        for name in (_part_class(part), _link_name(part)):
            if name and name in own:
                return name
    return _own_name(callee)


def _by_layer(callees: list[str]) -> list[str]:
    """The first chain of each name that vouches for `callees` (vouch_names): a refusal describes
    one chain per layer a reviewer must look at."""
    own = list(dict.fromkeys(_own_name(c) for c in callees))
    first: dict[str, str] = {}
    for callee in callees:
        first.setdefault(_cover(callee, own), callee)
    return list(first.values())


def vouch_name(callee: str) -> str:
    """The name a reviewer passes to --assume-pure for a callee description:
    'FusedMoE' for 'self.experts (FusedMoE, not visible to msrewrite)', else the callee itself.
    In a chain read from a package's source ('self.gate (ReplicatedLinear) -> current_platform.x
    (not visible ...)') the deepest layer class named, which a reviewer can vouch for as a whole."""
    parts = callee.split(" -> ")
    for part in reversed(parts):
        cls = _part_class(part)
        if cls:
            return cls
    return parts[-1].partition(" (")[0].removeprefix("self.")


def _part_class(part: str) -> str:
    """'ReplicatedLinear' for one link of a callee chain, 'self.gate (ReplicatedLinear)'; '' when it names none."""
    cls = part.partition(" (")[2].split(",")[0].split(" ")[0].rstrip(")")
    return cls if cls.isidentifier() and cls not in ("not", "set", "indexed", "a") else ""


# Main work inside the join statement -------------------------------------------------------
_JOIN_STATEMENTS = (cst.Assign, cst.AnnAssign, cst.AugAssign, cst.Return, cst.Expr)
_PURE_LEAVES = (cst.Name, cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString, cst.Ellipsis)


def _is_super_call(call: cst.Call) -> bool:
    func = call.func
    return (
        isinstance(func, cst.Attribute) and isinstance(func.value, cst.Call) and dotted_name(func.value.func) == "super"
    )


def _outer_main_calls(node: cst.CSTNode, seeds: set[int]) -> list[cst.Call]:
    """The main calls of a statement (`self.<sub>(...)` that is no side call, `super().<m>(...)`),
    outermost only (a main call in another's arguments runs as part of it), in source order; none
    inside a side call's arguments (those move with the side call)."""
    from msrewrite.analyze.defuse import self_callee

    found: list[cst.Call] = []

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> bool:
            if id(call) in seeds:
                return False
            if self_callee(call.func) is not None or _is_super_call(call):
                found.append(call)
                return False
            return True

    node.visit(_Calls())
    return found


def _evaluation_order(expr: cst.BaseExpression, atomic: set[int]) -> list[cst.CSTNode]:
    """The parts of `expr` in the order Python finishes evaluating them (operands before their
    operation, left to right, a call's function before its arguments). `atomic` nodes, names,
    literals, and every part that runs only on some paths or binds a name (conditional expressions,
    and/or, lambdas, comprehensions, :=, chained comparisons) are one step each, not entered."""
    order: list[cst.CSTNode] = []

    def walk(n: cst.CSTNode) -> None:
        if id(n) in atomic or isinstance(n, _PURE_LEAVES) or isinstance(n, (*_CONDITIONAL_EXPRESSIONS, cst.NamedExpr)):
            order.append(n)
            return
        steps = _operand_steps(n)
        if steps is None:
            order.append(n)  # anything else (an f-string, await, yield): one step, not entered
            return
        for part, enter in steps:
            if enter:
                walk(part)
            else:
                order.append(part)
        order.append(n)

    walk(expr)
    return order


def _operand_steps(n: cst.CSTNode) -> list[tuple[cst.CSTNode, bool]] | None:
    """What Python evaluates of `n` before `n` itself, in order: (part, True) for an operand to
    walk into, (part, False) for a step of its own (unpacking iterates the value). None for a
    node that is one step, not entered."""
    if isinstance(n, cst.Attribute):
        return [(n.value, True)]
    if isinstance(n, cst.Subscript):
        return [(n.value, True), *_slice_steps(n)]
    if isinstance(n, cst.Call):
        steps: list[tuple[cst.CSTNode, bool]] = [(n.func, True)]
        for arg in n.args:
            steps.append((arg.value, True))
            if arg.star:
                steps.append((arg, False))  # unpacking iterates the value
        return steps
    if isinstance(n, cst.BinaryOperation):
        return [(n.left, True), (n.right, True)]
    if isinstance(n, cst.UnaryOperation):
        return [(n.expression, True)]
    if isinstance(n, cst.Comparison) and len(n.comparisons) == 1:
        return [(n.left, True), (n.comparisons[0].comparator, True)]
    if isinstance(n, (cst.Tuple, cst.List, cst.Set)):
        steps = []
        for element in n.elements:
            steps.append((element.value, True))
            if isinstance(element, cst.StarredElement):
                steps.append((element, False))
        return steps
    if isinstance(n, cst.Dict):
        return _dict_steps(n)
    return None


def _slice_steps(n: cst.Subscript) -> list[tuple[cst.CSTNode, bool]]:
    """The index expressions of a subscript (each slice's bounds in order)."""
    steps: list[tuple[cst.CSTNode, bool]] = []
    for element in n.slice:
        part = element.slice
        if isinstance(part, cst.Index):
            steps.append((part.value, True))
        elif isinstance(part, cst.Slice):
            for bound in (part.lower, part.upper, part.step):
                if bound is not None:
                    steps.append((bound, True))
    return steps


def _dict_steps(n: cst.Dict) -> list[tuple[cst.CSTNode, bool]]:
    """A dict display's keys and values in order, and each `**` unpacking as a step."""
    steps: list[tuple[cst.CSTNode, bool]] = []
    for element in n.elements:
        if isinstance(element, cst.DictElement):
            steps.append((element.key, True))
        steps.append((element.value, True))
        if isinstance(element, cst.StarredDictElement):
            steps.append((element, False))
    return steps


def _statement_order(small: cst.BaseSmallStatement, atomic: set[int]) -> list[cst.CSTNode]:
    """`_evaluation_order` of a simple statement: an assignment's value before its targets, an
    augmented assignment's target (read) before its value."""
    if isinstance(small, cst.Assign):
        return [*_evaluation_order(small.value, atomic), *(t.target for t in small.targets)]
    if isinstance(small, cst.AnnAssign):
        return [*(_evaluation_order(small.value, atomic) if small.value is not None else []), small.target]
    if isinstance(small, cst.AugAssign):
        # `x += v` reads x first (a name: a plain load; `a[i] += v` indexes first: one step)
        return [small.target, *_evaluation_order(small.value, atomic), small]
    if isinstance(small, cst.Return):
        return _evaluation_order(small.value, atomic) if small.value is not None else []
    if isinstance(small, cst.Expr):
        return _evaluation_order(small.value, atomic)
    return [small]


def _join_main_hoists(
    join_fact: StatementFacts,
    side_names: set[str],
    is_seed: SeedPredicate,
    positions: dict[cst.CSTNode, CodeRange],
    taken: set[str],
    local_names: set[str],
    phased: bool,
) -> list[Hoist]:
    """The main calls to hoist out of the join statement (`h = self.experts(h) + shared`), when
    the window holds no main work of its own: each runs, in Python's order of evaluation, before
    the statement first reads a side output and after nothing but names, literals and calls that
    are hoisted too, so computing it into a temporary right before the join (on the flag-on path;
    the flag-off path keeps the statement as it is) runs exactly what ran before, in the same
    order. [] when the statement calls no main work; NoBranch with the reason otherwise."""
    node = join_fact.node
    line = join_fact.first_line
    seeds = {id(c) for c in _seed_calls(node, is_seed)}
    mains = _outer_main_calls(node, seeds)
    if not mains:
        return []
    names = ", ".join(dict.fromkeys(source(c.func) for c in mains))

    def refuse(why: str) -> NoBranch:
        why = " ".join(why.split()).replace("( ", "(").replace(" )", ")")  # a call written over several lines: one line
        return NoBranch(
            f"no main-path work between the fork and the join: nothing to overlap (the main work, {names}, is in "
            f"the join statement at line {line} itself; msrewrite does not hoist it out of that statement: {why})"
        )

    if not (
        isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1 and isinstance(node.body[0], _JOIN_STATEMENTS)
    ):
        raise refuse(
            f"it is {_statement_kind(node)}; main calls are hoisted only out of one assignment, return or expression"
        )
    if phased:
        raise refuse("a phased side branch needs main work between the fork and the join to anchor its phases")
    small = node.body[0]
    if _has_walrus(small):
        raise refuse("it binds a name with :=")
    conditional = _conditional_calls(small)
    order = _statement_order(small, {*map(id, mains), *seeds})
    ids = [id(n) for n in order]
    for call in mains:
        if id(call) not in ids or id(call) in conditional:
            what = conditional.get(id(call), "a conditional part of it")
            raise refuse(
                f"{source(call)} runs only on some paths of it ({what}); hoisting it would change how often it runs"
            )
        read = sorted(expression_loads(call) & side_names)
        if read:
            raise refuse(f"{source(call)} reads the side output '{read[0]}', so it can only run after the join")
    every_call = all_calls(small)
    functions = {id(c.func) for c in every_call}
    texts = [source(c) for c in every_call]
    twice = next((c for c in mains if texts.count(source(c)) > 1), None)
    if twice is not None:
        raise refuse(f"{source(twice)} appears more than once in it")
    _check_steps_before(order, ids, mains, seeds, functions, side_names, local_names, refuse)
    return _main_hoists_of(mains, positions, taken)


def _main_hoists_of(mains: list[cst.Call], positions: dict[cst.CSTNode, CodeRange], taken: set[str]) -> list[Hoist]:
    """Each main call of the join statement as a Hoist into a fresh temporary."""
    from msrewrite.analyze.defuse import self_callee

    hoisted: list[Hoist] = []
    for call in mains:
        where = positions[call]
        func = call.func
        callee = (
            dotted_name(func)
            or self_callee(func)
            or ("super_" + func.attr.value if isinstance(func, cst.Attribute) and _is_super_call(call) else "main")
        )
        hoisted.append(
            Hoist(
                call=call,
                temp=_temp_name(callee, taken),
                source=cst.Module(body=[]).code_for_node(call),
                first_line=where.start.line,
                last_line=where.end.line,
            )
        )
    return hoisted


def _maybe_outputs(outputs: list[str], whole: list[StatementFacts]) -> list[str]:
    """Side outputs bound only inside an `if` of the side branch, with no default bound before it on the side."""
    return [
        name
        for name in outputs
        if any(name in f.stores for f in whole if not isinstance(f.node, cst.SimpleStatementLine))
        and not any(name in f.stores and _binds_constant(f.node) for f in whole)
    ]


def _statement_kind(node: cst.BaseStatement) -> str:
    """'an `if`', 'several statements on one line', 'a Raise statement': what a join statement is."""
    if isinstance(node, cst.SimpleStatementLine):
        return "several statements on one line" if len(node.body) > 1 else f"a {type(node.body[0]).__name__} statement"
    return {
        "If": "an `if`",
        "For": "a `for` loop",
        "While": "a `while` loop",
        "With": "a `with` block",
        "Try": "a `try`",
    }.get(type(node).__name__, f"a {type(node).__name__}")


def _check_steps_before(
    order: list[cst.CSTNode],
    ids: list[int],
    mains: list[cst.Call],
    seeds: set[int],
    functions: set[int],
    side_names: set[str],
    local_names: set[str],
    refuse: Callable[[str], NoBranch],
) -> None:
    """Refuses when a step the join statement evaluates before its last main call (in `order`)
    is anything but a name that is no side output, a literal, a module attribute looked up to be
    called, or a hoisted call: hoisting the main calls ahead of it could change what either computes."""
    at = {id(call): ids.index(id(call)) for call in mains}
    last = max(at.values())
    skip = set(at) | seeds
    for k, step in enumerate(order[:last]):
        if id(step) in skip:
            continue
        later = next(c for c in mains if at[id(c)] > k)
        if isinstance(step, cst.Name):
            if step.value in side_names:
                raise refuse(
                    f"{source(later)} runs after the statement reads the side output '{step.value}'; "
                    "hoisting it would run it before that read"
                )
            continue
        if isinstance(step, _PURE_LEAVES) or (id(step) in functions and _global_attribute(step, local_names)):
            continue  # `torch.cat` / `F.silu` looked up to be called: no tensor work
        what = {
            cst.IfExp: "a conditional expression",
            cst.BooleanOperation: "an and/or",
            cst.Lambda: "a lambda",
            cst.Comparison: "a chained comparison",
        }.get(type(step), "")
        if not what and isinstance(step, (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)):
            what = "a comprehension"
        shown = source(step).strip()
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        what = f"{what} (`{shown}`)" if what else f"`{shown}`"
        raise refuse(
            f"{what} is evaluated before {source(later)}; hoisting the call ahead of it could change "
            "what either computes"
        )


def _global_attribute(node: cst.CSTNode, local_names: set[str]) -> bool:
    """`torch.cat`, `F.silu`: an attribute chain on a name the function does not bind (a module's)."""
    name = dotted_name(node) if isinstance(node, cst.Attribute) else None
    return name is not None and name != "" and name.split(".")[0] not in local_names and name.split(".")[0] != "self"


def _check_join_statement(join_fact, hoists, hoist_facts, storage: Storage, is_seed, scope) -> None:
    """Hoisting a side call out of its statement runs it before the rest of that statement, also
    with the flag off. Refuse when that changes what it reads: the statement writes (or binds with
    :=) one of the call's inputs before the call ran, or the call itself binds a name."""
    line = join_fact.first_line
    for hoist in hoists:
        if _has_walrus(hoist.call):
            raise NoBranch(
                f"line {line}: the side call binds a name with := inside its arguments; msrewrite does not hoist it"
            )
    seeds = set(map(id, _seed_calls(join_fact.node, is_seed)))
    node = join_fact.node
    if isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1 and isinstance(node.body[0], cst.AugAssign):
        node = node.body[0].value  # `y += side(x)`: the in-place add runs after the call

    class _Strip(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            return cst.Name("_ms_side_call") if id(original) in seeds else updated

    stripped = node.visit(_Strip())
    # calls that run after the side call(s) in Python's left-to-right order (they start after the
    # last one, as `super().forward(x)` in `self.shared(x) + super().forward(x)`), and calls taking
    # a side result as an argument: their own writes do not count. A call left of the side call,
    # an assignment target's included (evaluated after the value), counts: conservative.
    after: set[int] = set()
    seen = 0
    total = len([n for n in _simple_names(stripped) if n == "_ms_side_call"])

    class _After(Visitor):
        def visit_Name(self, name: cst.Name) -> None:
            nonlocal seen
            seen += name.value == "_ms_side_call"

        def visit_Call(self, call: cst.Call) -> None:
            if seen >= total or any("_ms_side_call" in expression_loads(a.value) for a in call.args):
                after.add(id(call))

    stripped.visit(_After())
    rest = node_facts(stripped, scope, after)
    walrus = _walrus_targets(stripped)
    inputs = {name for hf in hoist_facts for name in hf.loads}
    at = join_fact.index
    for name in sorted(inputs):
        if name in walrus:
            raise NoBranch(
                f"line {line} binds '{name}' (:=) before the side call reads it; msrewrite does not hoist the call"
            )
        mine = storage.held(name, at)
        hits = storage.written(rest, at, mine) + storage.maybe_written(rest, at, mine)
        if hits:
            written = sorted(hits, key=lambda n: (n != name, n))[0]
            raise NoBranch(
                f"line {line} writes '{written}' before the side call in the same statement reads it; "
                "hoisting the call would change its input"
            )


def _walrus_targets(node: cst.CSTNode) -> set[str]:
    names: set[str] = set()

    class _Finder(Visitor):
        def visit_NamedExpr(self, n: cst.NamedExpr) -> None:
            if isinstance(n.target, cst.Name):
                names.add(n.target.value)

    node.visit(_Finder())
    return names


def _has_walrus(node: cst.CSTNode) -> bool:
    return bool(_walrus_targets(node))


# An explicit choice of side calls (a plan from `suggest`, or one written by hand) --------------
_CONDITIONAL_EXPRESSIONS = (
    cst.IfExp,
    cst.BooleanOperation,
    cst.Lambda,
    cst.ListComp,
    cst.SetComp,
    cst.DictComp,
    cst.GeneratorExp,
)


def find_branch_for_calls(
    func: cst.FunctionDef,
    positions: dict[cst.CSTNode, CodeRange],
    calls: list[cst.Call],
    anchors: tuple[str, ...] = (),
    phase_anchors: tuple[str, ...] | None = None,
    scope: Scope | None = None,
    protect: bool = False,
) -> SideBranch:
    """The branch `find_side_branch` derives when exactly `calls` (nodes of `func`) are the side
    work, with every check it makes; plus one it leaves to its callers' seeds: a hoisted call must
    run exactly when its statement runs (not inside a conditional expression, a comprehension or
    a lambda), or hoisting it would change how often it runs, with the flag off too."""
    from msrewrite.analyze.defuse import self_callee

    chosen = {id(call) for call in calls}
    callees = {self_callee(call.func) for call in calls} - {None}

    def is_seed(callee: str) -> bool:
        return callee in callees

    is_seed.on_call = lambda call: id(call) in chosen  # type: ignore[attr-defined]
    branch = find_side_branch(
        func, positions, is_seed, anchors=anchors, phase_anchors=phase_anchors, scope=scope, protect=protect
    )
    if branch.hoists:
        conditional = _conditional_calls(branch.facts[branch.join].node)
        for hoist in branch.hoists:
            if id(hoist.call) in conditional:
                raise NoBranch(
                    f"line {hoist.first_line}: {hoist.source} runs only on some paths of its statement "
                    f"({conditional[id(hoist.call)]}); hoisting it would change how often it runs"
                )
    return branch


def _conditional_calls(node: cst.CSTNode) -> dict[int, str]:
    """id(call) -> the conditional expression around it, for calls not evaluated exactly once."""
    found: dict[int, str] = {}
    around: list[str] = []

    class _Finder(Visitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if isinstance(n, cst.Call) and around:
                found[id(n)] = around[-1]
            if isinstance(n, _CONDITIONAL_EXPRESSIONS):
                around.append(
                    {"IfExp": "a conditional expression", "BooleanOperation": "an and/or"}.get(
                        type(n).__name__, f"a {type(n).__name__}"
                    )
                )
            return True

        def on_leave(self, n: cst.CSTNode) -> None:
            if isinstance(n, _CONDITIONAL_EXPRESSIONS):
                around.pop()

    walk(node, _Finder())
    return found


def _compound_label(node: cst.CSTNode) -> str:
    """A compound statement as its reader writes it: "`if use_fused_gate`", "a `with` block"."""
    if isinstance(node, cst.If):
        return f"`if {source(node.test)}`"
    keyword = {
        cst.For: "for",
        cst.While: "while",
        cst.With: "with",
        cst.Try: "try",
        cst.Match: "match",
    }.get(type(node))
    return f"a `{keyword}` block" if keyword else "a compound statement"
