"""Candidates: independent branches that can move, with a plan, a case, a cost and a rank."""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msrewrite.analyze import digraph
from msrewrite.analyze.digraph import DiGraph
from msrewrite.analyze.stmtgraph import FunctionInfo, ModuleInfo, Statement, vouched
from msrewrite.plan import OverlapPlan
from msrewrite.records import record
from msrewrite.suggest import graph as g
from msrewrite.suggest.plans import SideChoice, apply_command, window_statements
from msrewrite.suggest.profiles import DeviceProfile

if TYPE_CHECKING:  # torch stays unimported on the static path
    from msrewrite.suggest.cost import BranchCost
    from msrewrite.suggest.trace import OpRecord, Trace


@record
class Candidate:
    plan: OverlapPlan
    tier: str  # "trace" or "static"
    choice: SideChoice
    cost: BranchCost | None = None
    cost_shapes: str = ""  # "full-size decode T=1", "tiny trace"
    confidence: str = "medium"
    notes: list[str] = field(default_factory=list)
    command: str = ""
    # Fewest syncs for one side stream: {"fork", "join", "fork_edges", "join_edges"} (see graph.sync_points).
    syncs: dict[str, int] | None = None
    fx_check: str = ""  # "independent", "dependent (...)", "unavailable (...)" or "" (no fx tier)

    @property
    def min_syncs(self) -> int | None:
        return self.syncs["fork"] + self.syncs["join"] if self.syncs else None

    @property
    def case(self) -> str:
        return self.plan.case

    @property
    def estimated_saving(self) -> float | None:
        return self.cost.saving if self.cost else None

    @property
    def pays_off(self) -> bool:
        """False when the cost model says the overlap saves nothing worth a sync."""
        return not (self.cost and (self.cost.too_small or self.cost.saving <= 0))

    def sort_key(self) -> tuple:
        # every field that tells two candidates apart, so ranking never depends on set order
        return (
            not self.pays_off,
            self.case == "generic",
            -(self.estimated_saving or 0.0),
            self.plan.fork_line,
            self.plan.function,
            tuple(map(tuple, self.plan.side_lines)),
            self.plan.join_line,
            self.plan.to_json(),
            repr(self.to_dict()),
        )

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "case": self.case,
            "file": self.plan.file,
            "function": self.plan.function,
            "side_lines": self.plan.side_lines,
            "join_line": self.plan.join_line,
            "fork_line": self.plan.fork_line,
            "estimated_saving": self.estimated_saving,
            "estimated_saving_us": round(self.cost.saving * 1e6, 3) if self.cost else None,
            "confidence": self.confidence,
            "tier": self.tier,
            "too_small": bool(self.cost and self.cost.too_small),
            "cost_shapes": self.cost_shapes,
            "min_syncs": self.min_syncs,
            "syncs": self.syncs,
            "fx_check": self.fx_check or None,
            "command": self.command,
            "notes": self.notes,
            "plan": self.plan.to_dict(),
        }
        if self.cost:
            data["cost"] = {
                "side_us": self.cost.side_time * 1e6,
                "main_us": self.cost.main_time * 1e6,
                "function_us": self.cost.scope_time * 1e6,
                "sync_us": self.cost.sync_time * 1e6,
                "side_flops": self.cost.side_flops,
                "main_flops": self.cost.main_flops,
                "side_bytes": self.cost.side_bytes,
                "main_bytes": self.cost.main_bytes,
                "critical_path_bound": self.cost.bound,
                "same_resource": self.cost.same_resource,
            }
        return data


def rank(candidates: list[Candidate]) -> list[Candidate]:
    unique: dict[tuple, Candidate] = {}
    for c in candidates:
        if not c.pays_off and c.confidence != "low":  # never recommended with confidence
            c.confidence = "low"
            c.notes.append("the cost model expects no worthwhile saving")
    for c in sorted(candidates, key=Candidate.sort_key):
        key = (c.plan.function, tuple(map(tuple, c.plan.side_lines)), c.plan.join_line)
        unique.setdefault(key, c)
    ranked = list(unique.values())
    for position, c in enumerate(ranked, 1):
        c.command = apply_command(c.case, c.plan.function, c.plan.file, position)
    return ranked


# Trace tier ---------------------------------------------------------------------------------------
def select_ops(scope: g.Scope, info: FunctionInfo, plan: OverlapPlan) -> tuple[list, list]:
    """(side ops, main window ops) of a plan inside one scope, by statement and hoisted submodule."""
    # by enclosing top-level statement: a guarded plan's side and join lines sit inside its `if`
    # (the estimate then counts that whole `if` as side work: coarse, on the safe side of a saving)
    whole = {_statement_at(info, s.first_line).index for s in plan.side if s.hoist is None}
    hoists = [s for s in plan.side if s.hoist is not None]
    join = _statement_at(info, plan.join_line).index
    window = {s.index for s in window_statements(info, plan)}
    side, main = [], []
    for op in scope.ops:
        stmt = scope.stmt_of[op.index]
        if stmt in whole:
            side.append(op)
        elif stmt == join and hoists and _under_call(scope, op, info.statements[join], hoists):
            side.append(op)
        elif stmt == join and plan.main_hoists and _under_call(scope, op, info.statements[join], plan.main_hoists):
            main.append(op)  # main work hoisted out of the join statement: it runs in the window
        elif stmt in window:
            main.append(op)
    return side, main


def _under_call(scope: g.Scope, op: OpRecord, stmt, hoists) -> bool:
    subs = g.submodule_of_ops(scope, frozenset([op.index]), {op.index: op})
    for call in stmt.calls:
        if any(h.source == call.source for h in hoists) and g.call_for_submodule(stmt, next(iter(subs))) is call:
            return True
    return False


def trace_candidates(
    trace: Trace, module: ModuleInfo, file: str, device: DeviceProfile, refused: list[dict] | None = None
) -> list[Candidate]:
    """Candidates from the traced op graph; branches the finder refuses go to `refused`, with why."""
    from msrewrite.suggest.cost import branch_cost, op_time

    memo: dict = {}  # the finder's answers per function: case shapes, side-call sets already tried

    by_index = {op.index: op for op in trace.ops}
    weight = {op.index: op_time(op, device) for op in trace.ops}
    found: list[Candidate] = []
    for scope in g.scopes(trace, module.functions):
        info = module.functions[scope.qualname]
        reduced = None
        ops_of_stmt: dict[int, set[int]] = {}
        for o, s in scope.stmt_of.items():
            ops_of_stmt.setdefault(s, set()).add(o)
        seen: set[SideChoice] = set()
        dag = g.op_dag(scope.ops)
        for pair in g.branch_pairs(scope, weight, limit=60):
            for side_ops, main_ops in ((pair.a_ops, pair.b_ops), (pair.b_ops, pair.a_ops)):
                choice = _choice(scope, info, side_ops, main_ops, pair.join_op, ops_of_stmt, by_index, dag)
                if choice is None or choice in seen:
                    continue
                seen.add(choice)
                candidate = _candidate(info, choice, file, "trace", memo, refused)
                if candidate is None:
                    continue
                side, main = select_ops(scope, info, candidate.plan)
                if not side or not main or not _independent(side, main, dag):
                    continue
                if reduced is None:
                    reduced = g.reduced_dag(scope.ops)
                candidate.syncs = g.sync_points(*reduced, {o.index for o in side})
                candidate.cost = branch_cost(side, main, scope.ops, device, syncs=candidate.min_syncs)
                candidate.cost_shapes = "tiny trace"
                found.append(candidate)
    return found


def _choice(scope, info, side_ops, main_ops, join_op, ops_of_stmt, by_index, dag) -> SideChoice | None:
    side_stmts = g.statements_of(scope, side_ops)
    main_stmts = g.statements_of(scope, main_ops)
    join_stmt = scope.stmt_of.get(join_op)
    if not side_stmts or side_stmts & main_stmts or join_stmt is None:
        return None
    hoist = None
    if join_stmt in side_stmts:
        in_join = frozenset(o for o in side_ops if scope.stmt_of.get(o) == join_stmt)
        subs = g.submodule_of_ops(scope, in_join, by_index)
        if len(subs) != 1 or "" in subs:
            return None
        call = g.call_for_submodule(info.statements[join_stmt], next(iter(subs)))
        if call is None:
            return None
        hoist = (join_stmt, call)
    whole = side_stmts - {join_stmt}
    # A moving statement may carry other ops (views, dead ends such as routing bookkeeping),
    # but none the main branch needs.
    for s in whole:
        for o in ops_of_stmt.get(s, ()):
            if o not in side_ops and (o in main_ops or digraph.descendants(dag, o) & main_ops):
                return None
    return SideChoice(statements=tuple(sorted(whole)), hoist=hoist)


def _independent(side: list[OpRecord], main: list[OpRecord], dag: DiGraph) -> bool:
    """No path between the side ops and the main window ops, either way (convexity)."""
    side_ids = {o.index for o in side}
    main_ids = {o.index for o in main}
    reach = set()
    for o in side_ids:
        reach |= digraph.descendants(dag, o)
    if reach & main_ids:
        return False
    back = set()
    for o in main_ids:
        back |= digraph.descendants(dag, o)
    return not (back & side_ids)


def _candidate(
    info: FunctionInfo, choice: SideChoice, file: str, tier: str, memo: dict, refused: list[dict] | None
) -> Candidate | None:
    """The plan the branch finder derives for the choice's side calls, named by the case whose own
    matcher derives the same branch, and checked exactly as `apply --plan` checks it; None (and
    the reason in `refused`) when the finder refuses it."""
    from msrewrite.analyze.branch import NoBranch
    from msrewrite.cases._base import Options
    from msrewrite.cases._finder import branch_plan
    from msrewrite.plancheck import GENERIC, case_shapes, check_plan_in, classify, derive_plan, submodule_calls

    # the side calls, collected as apply --plan collects them from the plan's statements
    assert info.node is not None  # a function of a parsed file: its node and statements' are kept
    calls = []
    for i in choice.statements:
        key = ("calls", info.qualname, i)
        if key not in memo:
            stmt_node = info.statements[i].node
            assert stmt_node is not None
            memo[key] = submodule_calls(stmt_node)
        calls += memo[key]
    if choice.hoist:
        calls.append(choice.hoist[1].node)
    seeds = ("seeds", info.qualname, frozenset(map(id, calls)))
    if seeds in memo:  # another choice with the same side calls: the finder's answer is the same
        return None
    memo[seeds] = True
    scope = _scope_of(info, file, memo)
    try:
        # as apply is given them: --protect (default auto: an input the main path may write is
        # snapshot) and --assume-pure, which the plan carries for `apply --plan` to re-check with
        assume_pure, protect_mode = vouched()
        protect = Options(protect=protect_mode, assume_pure=assume_pure)
        branch, plan = derive_plan(GENERIC, file, info.qualname, info.node, info.positions, calls, protect, scope)
        if ("shapes", info.qualname) not in memo:
            callees = {c.callee for s in info.statements for c in s.calls}
            memo["shapes", info.qualname] = case_shapes(info.node, info.positions, file, info.qualname, callees, scope)
        case, branch_name = classify(memo["shapes", info.qualname], plan)
        if case is not GENERIC:
            plan = branch_plan(case, Path(file), info.qualname, branch, protect)
            if branch_name:
                plan = plan.with_changes(case_branch=branch_name)
        plan = check_plan_in(info.node, info.positions, plan, derived_from=calls, scope=scope)  # as apply --plan will
        region = _fullgraph(info, file, memo)
        if region is not None:  # apply --plan refuses it there (emit/function_edit.py): never proposed
            raise NoBranch(
                f"{info.qualname} runs inside a torch.compile fullgraph region ({region}): stream code there "
                "would be traced into the graph"
            )
    except NoBranch as exc:
        if refused is not None:
            refused.append(_refusal(info, choice, tier, str(exc)))
        return None
    named = case is not GENERIC
    confidence = "high" if tier == "trace" and named else ("medium" if named or tier == "trace" else "low")
    return Candidate(plan=plan, tier=tier, choice=_choice_of(info, plan), confidence=confidence)


def _fullgraph(info: FunctionInfo, file: str, memo: dict) -> str | None:
    """The fullgraph compile `info` runs inside (emit/frameworks.py), as apply --plan finds it."""
    from msrewrite.emit.frameworks import fullgraph_region

    _scope_of(info, file, memo)  # parses the file once into memo["module"]
    if memo.get("module") is None:
        return None
    key = ("fullgraph", info.qualname)
    if key not in memo:
        if "text" not in memo:
            try:
                memo["text"] = Path(file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                memo["text"] = None
        memo[key] = fullgraph_region(memo["module"], info.qualname, memo["text"])
    return memo[key]


def _scope_of(info: FunctionInfo, file: str, memo: dict):
    """The function's scope from the file's summaries, as `apply --plan` re-derives it: the one its
    statement facts were computed under (analyze/stmtgraph.py), else from one whole-file parse
    per file; None if unreadable."""
    import libcst as cst

    from msrewrite.plancheck import summaries_scope

    if "module" not in memo and info.syntax is not None:
        memo["module"] = info.syntax  # the parse the facts came from
    if info.scope is not None:
        return info.scope
    if "module" not in memo:
        try:
            memo["module"] = cst.parse_module(Path(file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, cst.ParserSyntaxError, RecursionError):
            memo["module"] = None
    if memo["module"] is None:
        return None
    key = ("scope", info.qualname)
    if key not in memo:
        memo[key] = summaries_scope(memo["module"], info.qualname, vouched()[0], Path(file))
    return memo[key]


def _refusal(info: FunctionInfo, choice: SideChoice, tier: str, reason: str) -> dict:
    side = [info.statements[i].label for i in choice.statements]
    if choice.hoist:
        side.append(f"{choice.hoist[1].source} (hoisted from {info.statements[choice.hoist[0]].label})")
    return {"function": info.qualname, "side": side, "tier": tier, "reason": reason}


def _choice_of(info: FunctionInfo, plan: OverlapPlan) -> SideChoice:
    """The statements (and the hoisted call) of a derived plan, as dataflow indices."""
    index_at = {s.first_line: s.index for s in info.statements}
    # a guarded plan's side statements sit inside its `if`: they count as that statement
    whole = tuple(sorted({_statement_at(info, s.first_line).index for s in plan.side if s.hoist is None}))
    hoist = None
    hoisted = [s for s in plan.side if s.hoist is not None]
    if hoisted:
        join = index_at[plan.join_line]
        call = next((c for c in info.statements[join].calls if c.source == hoisted[0].source), None)
        hoist = (join, call) if call is not None else None
    return SideChoice(statements=whole, hoist=hoist)


# fx tier ------------------------------------------------------------------------------------------
_LEVELS = ("low", "medium", "high")


def fx_cross_check(candidate: Candidate, info: FunctionInfo, dag) -> None:
    """Check the side and main submodule calls against the fx module DAG; adjust the confidence."""
    from msrewrite.suggest.fxgraph import independence

    side = [c.callee for i in candidate.choice.statements for c in info.statements[i].calls]
    if candidate.choice.hoist:
        side.append(candidate.choice.hoist[1].callee)
    main = [c.callee for s in window_statements(info, candidate.plan) for c in s.calls]
    if candidate.plan.main_hoists:  # main work hoisted out of the join statement
        hoisted = {h.source for h in candidate.plan.main_hoists}
        main += [c.callee for c in _statement_at(info, candidate.plan.join_line).calls if c.source in hoisted]
    candidate.fx_check = independence(dag, side, main)
    level = _LEVELS.index(candidate.confidence)
    if candidate.fx_check == "independent":
        candidate.confidence = _LEVELS[min(level + 1, 2)]
        candidate.notes.append("fx module graph: side and main submodules are independent")
    elif candidate.fx_check.startswith("dependent"):
        candidate.confidence = _LEVELS[max(level - 1, 0)]
        candidate.notes.append(f"fx module graph disagrees: {candidate.fx_check}")


# Static tier --------------------------------------------------------------------------------------
# The branch finder reads the whole function for every choice; a long forward (a whole model's) has
# dozens of overlapping choices, the smallest of which the finder grows itself (glue, buffers).
MAX_STATIC_CHOICES = 8


def static_candidates(module: ModuleInfo, file: str, refused: list[dict] | None = None) -> list[Candidate]:
    """Candidates from the statement DAG; branches the finder refuses go to `refused`, with why."""
    found: list[Candidate] = []
    memo: dict = {}  # the finder's answers per function: case shapes, side-call sets already tried
    for qualname, info in module.functions.items():
        if not qualname.endswith(".forward"):
            continue
        for choice in _static_choices(info)[:MAX_STATIC_CHOICES]:
            candidate = _candidate(info, choice, file, "static", memo, refused)
            if candidate is not None:
                candidate.syncs = _static_syncs(info, candidate)
                candidate.cost_shapes = "static (no cost model)"
                candidate.notes.append(
                    "static tier: independence from the source's facts (names, in-place writes, "
                    "aliases); run without --static to check the traced op graph"
                )
                found.append(candidate)
    return found


def _static_choices(info: FunctionInfo) -> list[SideChoice]:
    """Exclusive-ancestor pairs on the statement DAG, with inline self-calls as their own nodes."""
    dag = info.graph(renaming=True)
    # a snapshot may lift a write after the side reads (--protect auto): the finder decides, and
    # with --protect none its refusal says why, as apply's would
    dag.remove_edges_from([(u, v) for u, v, data in dag.edges(data=True) if data["kind"] == "war"])
    for stmt in info.statements:
        inline = [c for c in stmt.calls if not c.whole]
        if stmt.compound or (len(stmt.calls) < 2 and not inline):
            continue  # a call inside an if/for/with/try never leaves it: the statement moves whole
        for k, call in enumerate(inline):
            node = ("call", stmt.index, k)
            dag.add_node(node, call=call)
            for name in call.uses:
                src = _reaching_def(info, name, stmt.index)
                if src is not None:
                    dag.add_edge(src, node, kind="data")
            dag.add_edge(node, stmt.index, kind="data")
    choices: list[SideChoice] = []
    ancestors = {n: digraph.ancestors(dag, n) | {n} for n in dag}
    for join in dag:
        preds = list(dag.predecessors(join))
        for i, a in enumerate(preds):
            for b in preds[i + 1 :]:
                for side, main in (
                    (ancestors[a] - ancestors[b], ancestors[b] - ancestors[a]),
                    (ancestors[b] - ancestors[a], ancestors[a] - ancestors[b]),
                ):
                    choice = _static_choice(info, dag, side, main, join)
                    if choice is not None and choice not in choices:
                        choices.append(choice)
    # smallest side first: the finder adds what a side call needs, so small choices cover big ones
    return sorted(choices, key=lambda c: (len(c.statements) + (c.hoist is not None), c.statements))


def _static_choice(info: FunctionInfo, dag: DiGraph, side: set, main: set, join) -> SideChoice | None:
    # The main branch needs a statement of its own with a call: calls inside the join statement
    # run after the join, so they leave the side nothing to overlap with.
    if not side or not main or not any(isinstance(n, int) and _heavy(info, n) for n in main):
        return None
    # Cheap roots (aliases, shapes) stay on the main stream: they only feed the side.
    side = set(side)
    changed = True
    while changed:
        changed = False
        for n in sorted((n for n in side if isinstance(n, int)), key=int):
            if not info.statements[n].has_call and not (set(dag.predecessors(n)) & side):
                side.discard(n)
                changed = True
    calls = [n for n in side if isinstance(n, tuple)]
    whole = [n for n in side if isinstance(n, int)]
    if len(calls) > 1 or not any(_heavy(info, n) for n in side):
        return None
    hoist = None
    if calls:
        _, stmt_index, _ = calls[0]
        if stmt_index != join:
            return None
        hoist = (stmt_index, dag.nodes[calls[0]]["call"])
    return SideChoice(statements=tuple(sorted(whole)), hoist=hoist)


def _statement_at(info: FunctionInfo, line: int) -> Statement:
    """The top-level statement of `info` spanning `line` (a plan's lines always lie in one)."""
    stmt = info.statement_at(line)
    assert stmt is not None, f"no statement of {info.qualname} spans line {line}"
    return stmt


def _heavy(info: FunctionInfo, node) -> bool:
    if isinstance(node, tuple):
        return True
    return bool(info.statements[node].calls)


def _reaching_def(info: FunctionInfo, name: str, before: int) -> int | None:
    for s in reversed(info.statements[:before]):
        if name in s.defs or name in s.mutates:
            return s.index
    return None


def _static_syncs(info: FunctionInfo, candidate: Candidate) -> dict[str, int]:
    """Sync points on the statement DAG (a hoisted call counts as its own statement, before its join)."""
    dag = info.graph(renaming=True)
    side_lines = {s.first_line for s in candidate.plan.side if s.hoist is None}
    side: set[int | tuple[str, int]] = {s.index for s in info.statements if s.first_line in side_lines}
    position: dict[int | str | tuple[str, int], float] = {s.index: float(s.index) for s in info.statements}
    if candidate.choice.hoist:
        join_index, call = candidate.choice.hoist
        node = ("hoist", join_index)
        dag.add_node(node)
        for name in call.uses:
            src = _reaching_def(info, name, join_index)
            if src is not None:
                dag.add_edge(src, node)
        dag.add_edge(node, join_index)
        position[node] = join_index - 0.5
        side.add(node)
    dag.add_node(g.ENTRY)
    position[g.ENTRY] = -1
    for n in list(dag.nodes):
        if n != g.ENTRY and dag.in_degree(n) == 0:
            dag.add_edge(g.ENTRY, n)  # reads the function's parameters
    return g.sync_points(digraph.transitive_reduction(dag), position, side)
