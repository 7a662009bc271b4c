"""One branch finder behind `apply --case`, `apply --plan` and `suggest`.

A plan names its side work by lines and source text. Before a plan is carried out (or proposed),
the calls it moves are handed to the same branch finder `apply --case` uses
(analyze/branch.py), which derives the fork, the join, what is hoisted, the inputs and outputs,
and refuses what could change results: the main path mutating, rebinding or aliasing a side input
in the window, an early exit, a call pulled out of its `if`/`for`/`with`/`try` or out of a
conditional expression, nothing to overlap. A plan is carried out only when it is exactly the
branch the finder derives; the lifetime facts (inputs, outputs, what is rebound) always come from
the analysis, never from the plan file.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst

from msrewrite.analyze.branch import NoBranch, SideBranch, find_branch_for_calls, find_side_branch, has_seed
from msrewrite.analyze.defuse import all_calls, self_callee
from msrewrite.analyze.positions import positions_for
from msrewrite.analyze.walk import Visitor
from msrewrite.cases._base import Case, Options
from msrewrite.cases._finder import branch_plan, check_main_hoists, check_rng_order
from msrewrite.emit.locate import locate
from msrewrite.emit.templates import code_of, strip_leading
from msrewrite.errors import BadInput
from msrewrite.plan import MODES, OverlapPlan, snapshots

# What `suggest` names a branch no case claims; carried out with `apply --plan`.
GENERIC = Case(
    name="generic",
    summary="any branch suggest found, carried out with apply --plan",
    modes=MODES,
    is_seed=lambda _callee: False,
    stream_tag="side",
    flag_name="ENABLE_SIDE_STREAM",
)


def submodule_calls(node: cst.CSTNode) -> list[cst.Call]:
    """The `self.<sub>(...)` calls of a statement (not those of nested functions or lambdas): the
    side work a moved statement stands for; glue and buffers around them follow by the finder."""
    found: list[cst.Call] = []

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            if self_callee(call.func) is not None:
                found.append(call)

        def visit_FunctionDef(self, _node: cst.FunctionDef) -> bool:
            return False

        def visit_Lambda(self, _node: cst.Lambda) -> bool:
            return False

    node.visit(_Calls())
    return found


def calls_of_plan(func: cst.FunctionDef, positions, plan: OverlapPlan) -> list[cst.Call]:
    """The side calls a plan names, found in `func`; a plan that no longer matches is stale."""
    if not isinstance(func.body, cst.IndentedBlock):
        raise BadInput(f"{plan.function}: a one-line function body cannot be split")
    body = list(func.body.body)
    by_line = {positions[s].start.line: s for s in body}
    guarded_if = by_line.get(plan.guard_line) if plan.guard_line else None
    todo = [guarded_if] if isinstance(guarded_if, cst.If) else []
    while todo:  # a guarded plan's side statements sit inside its `if` (or a nested `if`/`elif`)
        node = todo.pop()
        for block in (node.body, getattr(node.orelse, "body", None)):
            if isinstance(block, cst.IndentedBlock):
                by_line.update({positions[s].start.line: s for s in block.body if s in positions})
                todo += [s for s in block.body if isinstance(s, cst.If)]
        if isinstance(node.orelse, cst.If):
            todo.append(node.orelse)
    calls: list[cst.Call] = []
    for side in plan.side:
        if side.hoist:
            join = by_line.get(plan.join_line)
            found = [] if join is None else [c for c in all_calls(join) if code_of(c) == side.source]
            if len(found) != 1:
                raise BadInput(
                    f"stale plan for {plan.function}: the join statement at line {plan.join_line} "
                    f"does not contain {side.source!r} exactly once"
                )
            calls += found
            continue
        stmt = by_line.get(side.first_line)
        if stmt is None:
            raise BadInput(
                f"stale plan for {plan.function}: no statement starts at line {side.first_line} (side statement)"
            )
        if code_of(strip_leading(stmt)).strip() != side.source.strip():
            raise BadInput(
                f"stale plan for {plan.function}: line {side.first_line} no longer reads {side.source.strip()!r}"
            )
        calls += submodule_calls(stmt)  # glue and buffers without one follow their side calls
    if not calls:
        raise NoBranch("the plan moves no submodule call: the side work a plan moves is submodule calls")
    return calls


def summaries_scope(module: cst.Module, function: str, assume_pure: tuple[str, ...] = (), path: Path | None = None):
    """What the calls of `function` ("Class.method" or "function") do, from the file's summaries:
    without it every callee outside torch's table would count as pure."""
    from msrewrite.analyze.summaries import ModuleSummaries

    cls, _, name = function.rpartition(".")
    return ModuleSummaries(module, assume_pure, path=path).scope_for(cls or None, name)


def derive_plan(
    case: Case,
    file: str,
    function: str,
    func: cst.FunctionDef,
    positions,
    calls: list[cst.Call],
    options: Options | None = None,
    scope=None,
) -> tuple[SideBranch, OverlapPlan]:
    """The branch the finder derives for exactly these side calls, and its plan (raises NoBranch)."""
    options = options or Options()
    anchors = tuple(gate.anchor for gate in options.start_gates)
    branch = find_branch_for_calls(
        func,
        positions,
        calls,
        anchors=anchors,
        phase_anchors=options.phase_anchors or None,
        scope=scope,
        protect=snapshots(options.protect, options.start_gates),
    )
    check_rng_order(branch, options)
    check_main_hoists(case, branch)
    return branch, branch_plan(case, Path(file), function, branch, options)


def check_plan_in(
    func: cst.FunctionDef,
    positions,
    plan: OverlapPlan,
    derived_from: list[cst.Call] | None = None,
    scope=None,
    protect: bool | None = None,
) -> OverlapPlan:
    """`plan` re-derived by the branch finder: the plan to carry out, with the analysis' inputs,
    outputs and temporaries. Raises NoBranch with the finder's reason when it would refuse the
    move, or says where the plan differs from the branch it derives; BadInput when it is stale.

    `derived_from`: the side calls `plan` was just derived from (suggest). When the plan names
    exactly these calls, the finder (deterministic) would derive the same plan again: it is
    returned as is, without a second derivation.

    `protect`: a side input the main path may write is snapshot at the fork (--protect auto, apply's
    default); False refuses the move instead (--protect none); None: as the plan has it (snapshots
    when it carries any)."""
    from msrewrite.cases import get_case

    case = get_case(plan.case)
    if plan.placement == "routed":  # the finder derives the case's own branch; the swap is the case's
        raise BadInput(
            f"plan for {plan.function}: a --side routed plan is carried out by apply --case {plan.case} --side routed, "
            "not by apply --plan"
        )
    if case is not None and (case.analysis != "calls" or case.sync == "async-comm"):
        raise NoBranch(f"{plan.case} plans are not submodule-call branches; run apply --case {plan.case}")
    calls = calls_of_plan(func, positions, plan)
    if derived_from is not None and sorted(map(id, calls)) == sorted(map(id, derived_from)):
        return plan
    options = Options(
        mode=plan.mode,
        flag=plan.flag,
        stream_tag=plan.stream_tag,
        start_gates=plan.start_gates,
        phase_anchors=plan.phase_anchors,
        core_limits=plan.core_limits,
        protect="auto" if (plan.protect_inputs if protect is None else protect) else "none",
        assume_pure=plan.assume_pure,
        allow_rng_reorder=plan.allow_rng_reorder,
    )
    _branch, derived = derive_plan(case or GENERIC, plan.file, plan.function, func, positions, calls, options, scope)
    _same_shape(plan, derived)
    # Everything the emitter needs for correctness comes from the analysis; the plan file only
    # chooses what a user may choose (mode, switch, stream tag, gates).
    return derived.with_changes(file=plan.file, case_branch=plan.case_branch, summary=plan.summary or derived.summary)


def check_plan(
    module: cst.Module,
    plan: OverlapPlan,
    text: str | None = None,
    path: Path | None = None,
    protect: bool | None = None,
) -> OverlapPlan:
    """`check_plan_in` for the plan's function in `module` (whose source is `text` when known,
    read from `path`, whose sibling modules the summaries may read)."""
    if plan.placement == "routed":
        return _check_routed(module, plan, text, path, protect)
    located = locate(module, plan.function)
    scope = summaries_scope(module, plan.function, plan.assume_pure, path)
    positions = positions_for(module, plan.function, located.func, text)
    return check_plan_in(located.func, positions, plan, scope=scope, protect=protect)


def _check_routed(
    module: cst.Module, plan: OverlapPlan, text: str | None, path: Path | None, protect: bool | None
) -> OverlapPlan:
    """A --side routed plan, derived again the way `apply --case CASE --side routed` derives it
    (the case finds its shared-expert branch, cases/_placement.py swaps the two sets) and held
    against the plan like any other: the plan chooses only what a user may choose."""
    from msrewrite.cases import get_case

    case = get_case(plan.case)
    if case is None or "--side" not in {option.name for option in case.options}:
        raise NoBranch(f"plan for {plan.function}: --side routed plans belong to a case that takes --side")
    locate(module, plan.function)  # a stale plan: BadInput, as for any other
    options = Options(
        mode=plan.mode,
        flag=plan.flag,
        stream_tag=plan.stream_tag,
        start_gates=plan.start_gates,
        phase_anchors=plan.phase_anchors,
        core_limits=plan.core_limits,
        protect="auto" if (plan.protect_inputs if protect is None else protect) else "none",
        assume_pure=plan.assume_pure,
        allow_rng_reorder=plan.allow_rng_reorder,
        extra={"side": "routed"},
    )
    targets = [t for t in case.find(path or Path(plan.file), module, options, text) if t.function == plan.function]
    derived = next((t.plan for t in targets if t.plan is not None), None)
    if derived is None:
        reason = next((t.reason for t in targets if t.reason), "")
        raise NoBranch(reason or f"{plan.case} finds no shared-expert branch in {plan.function}")
    _same_shape(plan, derived)
    return derived.with_changes(file=plan.file, case_branch=plan.case_branch, summary=plan.summary or derived.summary)


def _same_shape(plan: OverlapPlan, derived: OverlapPlan) -> None:
    def lines(p: OverlapPlan) -> dict[tuple, tuple]:
        return {(s.first_line, s.source if s.hoist else None): (s.last_line, s.phase) for s in p.side}

    mine, theirs = lines(plan), lines(derived)
    for key in sorted(set(theirs) - set(mine), key=str):
        what = f"the call {key[1]}" if key[1] else f"line {key[0]}"
        raise NoBranch(f"the side branch also needs {what}, which the plan leaves on the main path")
    for key in sorted(set(mine) - set(theirs), key=str):
        if key[1]:
            raise NoBranch(f"the plan hoists {key[1]} out of line {plan.join_line}, which the analysis does not")
        raise NoBranch(f"line {key[0]} is not side work: the analysis keeps it on the main path")
    for key, (_last, phase) in mine.items():
        if phase != theirs[key][1]:
            raise NoBranch(f"line {key[0]} belongs to phase {theirs[key][1]}, not {phase}")
    main_mine = {(h.first_line, " ".join(h.source.split())) for h in plan.main_hoists}
    main_theirs = {(h.first_line, " ".join(h.source.split())) for h in derived.main_hoists}
    for _line, source in sorted(main_theirs - main_mine):
        raise NoBranch(
            f"the analysis hoists the main call {source} out of the join at line {derived.join_line} (the only main "
            "work of the window), which the plan does not"
        )
    for _line, source in sorted(main_mine - main_theirs):
        raise NoBranch(
            f"the plan hoists the main call {source} out of line {plan.join_line}, which the analysis does not"
        )
    if plan.fork_line != derived.fork_line:
        raise NoBranch(
            f"the side branch forks at line {derived.fork_line} (once its inputs hold their values), "
            f"not line {plan.fork_line}"
        )
    if plan.join_line != derived.join_line:
        raise NoBranch(
            f"the side branch joins at line {derived.join_line} (the first use of its outputs), not line {plan.join_line}"
        )


# Which case a branch is: each case's own matcher ------------------------------------------------
def shape(plan: OverlapPlan) -> tuple:
    return (
        plan.fork_line,
        plan.join_line,
        tuple(sorted((s.first_line, s.last_line, s.hoist is not None) for s in plan.side)),
    )


def case_shapes(
    func: cst.FunctionDef,
    positions,
    file: str,
    function: str,
    callees: set[str] | None = None,
    scope=None,
) -> list[tuple[Case, str, tuple]]:
    """(case, branch name, shape) of the branch each call-seeded case's own finder derives here.
    `callees`: the function's `self.<...>` callees when known (skips cases with no seed among them)."""
    from msrewrite.cases import all_cases

    found = []
    for case in all_cases():
        if case.analysis != "calls" or case.phased or case.sync == "async-comm" or func.name.value == "__init__":
            continue
        for name, is_seed in [(b.name, b.is_seed) for b in case.branches] or [("", case.is_seed)]:
            if callees is not None and not any(is_seed(c) for c in callees):
                continue
            if not has_seed(func, is_seed):
                continue
            try:
                branch = find_side_branch(func, positions, is_seed, scope=scope, protect=True)
            except NoBranch:
                continue
            found.append((case, name, shape(branch_plan(case, Path(file), function, branch, Options()))))
    return found


def classify(shapes: list[tuple[Case, str, tuple]], plan: OverlapPlan) -> tuple[Case, str]:
    """The first case whose matcher derives exactly this branch (so `apply --case` makes this very
    edit), else GENERIC."""
    for case, name, their_shape in shapes:
        if their_shape == shape(plan):
            return case, name
    return GENERIC, ""
