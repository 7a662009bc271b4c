"""Which branch of a plan runs on the side stream (`apply --side shared|routed`, plan.placement).

The branch analysis (analyze/branch.py) finds the case's side work (the seed calls: the shared
expert) and the window between the fork and the join, and proves the two independent both ways:
neither writes what the other reads or writes, except inputs the window may write after the side
work read them, which are snapshot at the fork (--protect). Independence is symmetric, so the
window's work (the router and routed experts) may run on the side stream instead, the seed calls
staying on the current stream, as SGLang's engineers write it with `self.alt_stream`. The routed
plan is the same plan with the two sets swapped:

    the window's statements   -> side statements (issued on the side stream at the fork)
    main calls hoisted out of the join statement -> side hoists
    the seed statements       -> the window's main work (on the current stream)
    seed calls hoisted out of the join statement -> main hoists (run right before the join)

and the snapshots are read by the seed statements on the current stream (the side stream may write
the originals). What the swap cannot carry (an `if` around the seed calls, phases, a window that may
leave the function) is said in one line, and the plan keeps its shared placement or is refused.
"""

from __future__ import annotations

import libcst as cst

from msrewrite.analyze.defuse import Scope, StatementFacts, statement_facts
from msrewrite.analyze.outline import bound_on_every_path, iter_functions
from msrewrite.analyze.positions import positions_for
from msrewrite.analyze.walk import Visitor
from msrewrite.emit.templates import code_of, strip_leading
from msrewrite.plan import OverlapPlan, SideStatement


def routed_plan(
    plan: OverlapPlan, module: cst.Module, text: str | None, scope: Scope | None = None
) -> tuple[OverlapPlan | None, str]:
    """(`plan` with the window's work on the side stream and the seed calls on the current one,
    ""), or (None, why that placement is not possible for it). `scope`: the file's summaries for
    the function, so that what its callees change is seen too."""
    why = _unsupported_shape(plan)
    if why:
        return None, why
    func = next((f for name, f, _cls in iter_functions(module) if name == plan.function), None)
    if func is None or not isinstance(func.body, cst.IndentedBlock):
        return None, f"{plan.function} is not a function with a body of statements"
    if func.asynchronous is not None:
        return None, "an async function's window may suspend while the side stream is current"
    body = list(func.body.body)
    positions = positions_for(module, plan.function, func, text)
    facts = statement_facts(body, positions, scope)
    starts = {f.first_line: f.index for f in facts}
    fork = starts.get(plan.fork_line)
    join = len(facts) if plan.join_line == facts[-1].last_line + 1 else starts.get(plan.join_line)
    seeds = [starts.get(s.first_line) for s in plan.side if s.hoist is None]
    if fork is None or join is None or None in seeds:
        return None, "the fork, the join or a side statement lies inside a block (a `with`), not in the function body"
    seed_idx = {i for i in seeds if i is not None}
    if any(not fork <= i < join for i in seed_idx):
        return None, "a statement of the side work comes before the fork"
    seed_hoists = [s for s in plan.side if s.hoist is not None]
    if seed_hoists and seed_idx:
        return None, (
            "the side work is both whole statements and a call inside the join statement; only one of them can "
            "stay on the current stream"
        )
    window = [f for f in facts[fork:join] if f.index not in seed_idx]
    why = _cannot_move(window) or _rebinds_before_read(
        [facts[i] for i in sorted(seed_idx)], window, set(plan.protect_inputs)
    )
    if why:
        return None, why
    routed_hoists = list(plan.main_hoists)
    if not any(f.has_call for f in window) and not routed_hoists:
        return None, "the window holds no calls to move"
    inputs, outputs, rebound, maybe = _lifetimes(plan, func, facts, window, fork, join, routed_hoists)
    side = [
        SideStatement(f.first_line, f.last_line, code_of(strip_leading(f.node)).strip()) for f in window
    ] + routed_hoists
    return (
        plan.with_changes(
            side=tuple(side),
            main_hoists=tuple(seed_hoists),
            side_inputs=tuple(inputs),
            side_outputs=tuple(outputs),
            inputs_rebound_before_join=tuple(rebound),
            outputs_maybe_unbound=tuple(maybe),
            placement="routed",
        ),
        "",
    )


def _unsupported_shape(plan: OverlapPlan) -> str:
    if plan.guard:
        return f"the side work sits inside `if {plan.guard}`, and the window outside it"
    if plan.phase_anchors:
        return "the side work runs in phases"
    if plan.start_gates:
        return "--start-after gates the side work's input"
    if plan.core_limits:
        return "the branches get core budgets of their own"
    if plan.sync != "wait_stream" or plan.stream_source != "lazy" or plan.inline_guards or plan.case_branch:
        return "the case syncs or makes its streams in a way of its own"
    return ""


class _Leaves(Visitor):
    """`return`, `yield`, `await`, `raise`, `assert`, `global`, `nonlocal` (nested functions aside)."""

    def __init__(self) -> None:
        self.found = ""

    def _saw(self, what: str) -> None:
        self.found = self.found or what

    def visit_Return(self, _node: cst.Return) -> None:
        self._saw("`return`")

    def visit_Yield(self, _node: cst.Yield) -> None:
        self._saw("`yield`")

    def visit_Await(self, _node: cst.Await) -> None:
        self._saw("`await`")

    def visit_Raise(self, _node: cst.Raise) -> None:
        self._saw("`raise`")

    def visit_Assert(self, _node: cst.Assert) -> None:
        self._saw("`assert`")

    def visit_Global(self, _node: cst.Global) -> None:
        self._saw("`global`")

    def visit_Nonlocal(self, _node: cst.Nonlocal) -> None:
        self._saw("`nonlocal`")

    def visit_FunctionDef(self, _node: cst.FunctionDef) -> bool:
        return False

    def visit_Lambda(self, _node: cst.Lambda) -> bool:
        return False


def _cannot_move(window: list[StatementFacts]) -> str:
    """Why the window's statements cannot run inside `with <side stream>:` at the fork: one that
    may leave the function (or raise) there would skip the join, or run before the side work of the
    current stream that it followed."""
    for f in window:
        leaves = _Leaves()
        f.node.visit(leaves)
        if leaves.found:
            return f"line {f.first_line} of the window holds {leaves.found}, which must not move onto the side stream"
    return ""


class _OuterNames(Visitor):
    """Names a statement mentions in the function's own scope: not the targets of a comprehension
    or the parameters of a lambda inside it (the facts' loads and stores count those too)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.shadowed: list[set[str]] = []

    def _enter(self, node: cst.ListComp | cst.SetComp | cst.DictComp | cst.GeneratorExp) -> None:
        bound: set[str] = set()
        comp: cst.CompFor | None = node.for_in
        while comp is not None:
            bound |= _target_names(comp.target)
            comp = comp.inner_for_in
        self.shadowed.append(bound)

    def visit_ListComp(self, node: cst.ListComp) -> None:
        self._enter(node)

    def visit_SetComp(self, node: cst.SetComp) -> None:
        self._enter(node)

    def visit_DictComp(self, node: cst.DictComp) -> None:
        self._enter(node)

    def visit_GeneratorExp(self, node: cst.GeneratorExp) -> None:
        self._enter(node)

    def leave_ListComp(self, _node: cst.ListComp) -> None:
        self.shadowed.pop()

    def leave_SetComp(self, _node: cst.SetComp) -> None:
        self.shadowed.pop()

    def leave_DictComp(self, _node: cst.DictComp) -> None:
        self.shadowed.pop()

    def leave_GeneratorExp(self, _node: cst.GeneratorExp) -> None:
        self.shadowed.pop()

    def visit_Lambda(self, node: cst.Lambda) -> None:
        params = node.params
        self.shadowed.append({p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)})

    def leave_Lambda(self, _node: cst.Lambda) -> None:
        self.shadowed.pop()

    def visit_Name(self, node: cst.Name) -> None:
        if not any(node.value in bound for bound in self.shadowed):
            self.names.add(node.value)

    def visit_FunctionDef(self, _node: cst.FunctionDef) -> bool:
        return False


def _target_names(node: cst.CSTNode) -> set[str]:
    if isinstance(node, cst.Name):
        return {node.value}
    if isinstance(node, (cst.Tuple, cst.List)):
        return set().union(*(_target_names(e.value) for e in node.elements)) if node.elements else set()
    if isinstance(node, cst.StarredElement):
        return _target_names(node.value)
    return set()


def _outer(f: StatementFacts) -> set[str]:
    found = _OuterNames()
    f.node.visit(found)
    return found.names


def _rebinds_before_read(seeds: list[StatementFacts], window: list[StatementFacts], snapshots: set[str]) -> str:
    """Why issuing the window's statements at the fork, before side statements that precede them,
    would change what a name holds: a window statement after a side statement binds a name that
    side statement reads (it would read the new binding; a snapshot input reads its copy, bound at
    the fork) or binds itself (the last binding would change)."""
    for seed in seeds:
        reads = (seed.loads & _outer(seed)) - snapshots
        binds = seed.stores & _outer(seed)
        state = _self_paths(seed.node)
        for f in window:
            if f.index < seed.index:
                continue
            clash = sorted(f.stores & _outer(f) & (reads | binds))
            if clash:
                return (
                    f"line {f.first_line} rebinds {clash[0]!r}, which line {seed.first_line} (kept on the current "
                    f"stream) {'reads' if clash[0] in reads else 'binds'} first; issued at the fork, line "
                    f"{f.first_line} would run before it"
                )
            changed = sorted(
                path
                for path in f.self_stores | f.rebinds
                if any(path == used or path.startswith(used + ".") or used.startswith(path + ".") for used in state)
            )
            if changed:
                return (
                    f"line {f.first_line} changes {changed[0]}, which line {seed.first_line} (kept on the current "
                    f"stream) uses first; issued at the fork, line {f.first_line} would run before it"
                )
    return ""


def _self_paths(node: cst.CSTNode) -> set[str]:
    """The `self.a.b` attribute paths a statement mentions (its module state), longest first."""
    found: set[str] = set()

    class _Paths(Visitor):
        def visit_Attribute(self, attr: cst.Attribute) -> bool:
            parts = [attr.attr.value]
            value = attr.value
            while isinstance(value, cst.Attribute):
                parts.append(value.attr.value)
                value = value.value
            if isinstance(value, cst.Name) and value.value == "self":
                found.add(".".join(["self", *reversed(parts)]))
                return False
            return True

    node.visit(_Paths())
    return found


class _Deleted(Visitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Del(self, node: cst.Del) -> None:
        targets = [e.value for e in node.target.elements] if isinstance(node.target, cst.Tuple) else [node.target]
        self.names |= {t.value for t in targets if isinstance(t, cst.Name)}

    def visit_FunctionDef(self, _node: cst.FunctionDef) -> bool:
        return False


def _lifetimes(
    plan: OverlapPlan,
    func: cst.FunctionDef,
    facts: list[StatementFacts],
    window: list[StatementFacts],
    fork: int,
    join: int,
    routed_hoists: list[SideStatement],
) -> tuple[list[str], list[str], list[str], list[str]]:
    """(inputs, outputs, inputs to keep alive on the side stream, outputs bound on some paths only)
    of the window's work on the side stream."""
    params = func.params
    param_names = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            param_names.add(star.name.value)
    # an input holds its value at the fork: a parameter, or bound in the function's scope before it
    bound_before = param_names | {n for f in facts[:fork] for n in f.stores & _outer(f)}
    stored: set[str] = set()
    inputs: list[str] = []
    deleted: set[str] = set()
    join_loads = (facts[join].loads & _outer(facts[join])) if join < len(facts) else set()
    for f in window:
        reads = f.loads & _outer(f)
        inputs += sorted(n for n in reads - stored - set(inputs) if n in bound_before and n != "self")
        stored |= f.stores & _outer(f)
        found = _Deleted()
        f.node.visit(found)
        deleted |= found.names
    if routed_hoists:  # the main calls hoisted out of the join read what the join statement reads
        inputs += sorted(n for n in join_loads - stored - set(inputs) if n in bound_before and n != "self")
    # the first input as the shared plan had it (--max-tokens counts its tokens) when the window reads it
    first = plan.side_inputs[0] if plan.side_inputs else ""
    inputs.sort(key=lambda n: n != first)
    later = set().union(*(f.loads for f in facts[join:])) if join < len(facts) else set()
    outputs = sorted(n for n in stored if n in later) + [h.hoist for h in routed_hoists if h.hoist]
    # Tensors made on the current stream that the side stream reads, and whose name the side work
    # rebinds or deletes: the last reference may go before the side stream is done with them.
    rebound = sorted(n for n in inputs if n in stored or n in deleted)
    always = set().union(*(bound_on_every_path(f.node) for f in window)) if window else set()
    maybe = [n for n in outputs if n in stored and n not in always and n not in bound_before]
    return inputs, outputs, rebound, maybe
