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

from dataclasses import dataclass, field
from typing import Callable

import libcst as cst
from libcst.metadata import CodeRange

from msrewrite.analyze.defuse import (
    is_docstring,
    node_facts,
    StatementFacts,
    dotted_name,
    expression_loads,
    function_names,
    statement_facts,
)


@dataclass
class Hoist:
    call: cst.Call
    temp: str
    source: str
    first_line: int
    last_line: int


@dataclass
class SideBranch:
    statements: list[StatementFacts]  # whole statements that move, in order
    hoists: list[Hoist]  # seed calls lifted out of the join statement
    fork: int  # body index the side block goes before
    join: int  # body index of the first consumer
    inputs: list[str]
    outputs: list[str]
    rebound_inputs: list[str]  # inputs the main path rebinds before the join
    maybe_outputs: list[str] = field(default_factory=list)  # bound only on some paths (inside an if)
    phases: dict[int, int] = field(default_factory=dict)  # side statement index -> phase
    phase_anchors: list[str] = field(default_factory=list)
    facts: list[StatementFacts] = field(default_factory=list)


class NoBranch(Exception):
    """The function has seed calls but no branch that can safely move; the message says why."""


SeedPredicate = Callable[[str], bool]  # dotted callee after "self." -> is it side work?


def _seed_calls(node: cst.CSTNode, is_seed: SeedPredicate) -> list[cst.Call]:
    found: list[cst.Call] = []

    on_call = getattr(is_seed, "on_call", None)  # seeds that are not submodule calls (dist.send)

    class _Finder(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            if on_call is not None:
                if on_call(call):
                    found.append(call)
                return
            callee = dotted_name(call.func)
            if callee and callee.startswith("self.") and is_seed(callee[len("self.") :]):
                found.append(call)

        def visit_FunctionDef(self, n: cst.FunctionDef) -> bool:
            return False

    if isinstance(node, cst.FunctionDef):
        node = node.body
    node.visit(_Finder())
    return found


def has_seed(node: cst.CSTNode, is_seed: SeedPredicate) -> bool:
    return bool(_seed_calls(node, is_seed))


def _temp_name(callee: str, taken: set[str]) -> str:
    base = callee.split(".")[-1] + "_output"
    name, n = base, 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def find_side_branch(
    func: cst.FunctionDef,
    positions: dict[cst.CSTNode, CodeRange],
    is_seed: SeedPredicate,
    anchors: tuple[str, ...] = (),
    phase_anchors: tuple[str, ...] | None = None,
) -> SideBranch:
    """The side branch of `func`; `anchors` are main-stream values the side must start after."""
    body = list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []
    facts = statement_facts(body, positions)
    seeds = [f for f in facts if has_seed(f.node, is_seed)]
    if not seeds:
        raise NoBranch("no side-branch call in this function")
    for f in seeds:
        if isinstance(f.node, cst.SimpleStatementLine):
            continue
        # `if self.shared_experts is not None: out = self.shared_experts(x)` moves as one unit,
        # as long as everything it calls is side work and it cannot leave the function.
        if not isinstance(f.node, cst.If) or f.exits or not all(is_seed(c) for c in f.self_calls):
            raise NoBranch(
                f"line {f.first_line}: the side-branch call sits inside a {type(f.node).__name__} "
                "that also does other work, which msrewrite does not split"
            )

    def reaching_def(name: str, before: int, skip: set[int]) -> int | None:
        for f in reversed(facts[:before]):
            if f.index not in skip and name in f.stores:
                return f.index
        return None

    # Main work = statements calling submodules outside the side branch, and everything that
    # reads their results. A seed statement that depends on main work is the join; its seed
    # calls are hoisted out of it instead.
    seed_idx = {f.index for f in seeds}
    def last_writer(name: str, before: int) -> int | None:
        # an in-place write (`x.index_add_(...)`, `x += y`) changes the value as much as a rebinding
        for f in reversed(facts[:before]):
            if name in f.stores or name in f.mutates:
                return f.index
        return None

    # A seed statement depends on the main path only through what it reads outside its side
    # calls: `h = h + self.shared_experts(x)` (h is routed output: the join, hoist the call) vs
    # `s = self.shared_experts(w)` (w may come from the router: then the fork simply follows it).
    depends_on_main: dict[int, bool] = {}
    for f in facts:
        dep = f.index not in seed_idx and bool(f.self_calls)
        loads = _outer_loads(f.node, is_seed) if f.index in seed_idx else f.loads
        for name in loads:
            d = last_writer(name, f.index)
            if d is not None and depends_on_main[d]:
                dep = True
        depends_on_main[f.index] = dep

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
    # Buffers prepared only for the side branch (`buf = torch.empty_like(x)` before a recv) move
    # with it: no submodule call, no in-place write, and only side statements read the result.
    for f in facts:
        if f.index in pure or not pure or f.index > max(pure):
            continue
        # statements that see this very definition (not a later rewrite, such as a recv filling it)
        readers = [
            g for g in facts[f.index + 1 :] if any(last_writer(n, g.index) == f.index for n in f.stores & g.loads)
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
    whole = [facts[i] for i in sorted(pure)]
    impure = [f for f in seeds if depends_on_main[f.index]]
    side_idx = {f.index for f in whole}
    # Outputs: side results read after the branch (the join and later), in definition order.
    # Temporaries used only inside the branch stay on the side stream and need no guard.
    side_stores: list[str] = []
    for f in whole:
        side_stores.extend(n for n in sorted(f.stores) if n not in side_stores)
    read_after = {name for f in facts[max(side_idx) + 1 :] if f.index not in side_idx for name in f.loads} if side_idx else set()
    outputs = [n for n in side_stores if n in read_after]

    # The join: first statement after the side statements that reads a side output, or the
    # impure seed statement whose calls get hoisted.
    join = None
    first_side = min(side_idx) if side_idx else None
    for f in facts:
        if f.index in side_idx or (first_side is not None and f.index < first_side):
            continue
        if f in impure or (f.loads & set(outputs) and any(
            reaching_def(n, f.index, set()) in side_idx for n in f.loads & set(outputs)
        )):
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

    hoists: list[Hoist] = []
    taken = function_names(func)
    join_fact = facts[join]
    if join_fact in impure and not isinstance(join_fact.node, cst.SimpleStatementLine):
        raise NoBranch(
            f"line {join_fact.first_line}: the side call is conditional inside the join "
            f"({type(join_fact.node).__name__}); hoisting it would run it unconditionally"
        )
    if join_fact in impure:
        for call in _seed_calls(join_fact.node, is_seed):
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
        outputs.extend(h.temp for h in hoists)

    # Inputs: names the side reads that it does not define itself first.
    inputs: list[str] = []
    defined: set[str] = set()
    units: list[tuple[int, set[str], set[str]]] = [(f.index, f.loads, f.stores) for f in whole]
    units += [(join, expression_loads(h.call), {h.temp}) for h in hoists]
    for _, loads, stores in units:
        for name in sorted(loads - defined):
            if name not in inputs:
                inputs.append(name)
        defined |= stores

    # Fork: the earliest point where every input already holds the value the side reads, and
    # never before the docstring.
    fork = 1 if is_docstring(body[0]) else 0
    for index, loads, _ in units:
        for name in loads & set(inputs):
            d = reaching_def(name, index, side_idx)
            if d is None:
                continue
            fork = max(fork, d + 1)  # after the input exists, even when the main path made it
    for anchor in anchors:
        d = reaching_def(anchor, join, side_idx)
        if d is None:
            raise NoBranch(f"start anchor '{anchor}' is not assigned before the join")
        fork = max(fork, d + 1)
    for index, loads, _ in units:
        for name in loads & set(inputs):
            if reaching_def(name, index, side_idx) != reaching_def(name, fork, side_idx):
                raise NoBranch(
                    f"'{name}' is rebound between the fork and the side statement at line "
                    f"{facts[index].first_line}"
                )

    start = min([fork, *side_idx])
    params = {p.name.value for p in (*func.params.params, *func.params.kwonly_params, *func.params.posonly_params)}
    local_names = params | {name for f in facts for name in f.stores}
    aliases = _alias_closure(facts, set(inputs) & local_names, upto=join, local_names=local_names)
    for f in facts[start:join]:
        if f.index in side_idx:
            continue
        if f.exits:
            raise NoBranch(f"line {f.first_line} can return before the join")
        touched = f.mutates & aliases
        if touched:
            raise NoBranch(
                f"line {f.first_line} writes '{sorted(touched)[0]}' in place while the side stream reads it"
            )
        clash = (f.loads | f.stores) & (set(outputs) | set(side_stores))
        if clash:
            raise NoBranch(f"line {f.first_line} uses '{sorted(clash)[0]}' between the fork and the join")
    for f in whole:
        bad = f.mutates & aliases
        if bad:
            raise NoBranch(f"line {f.first_line}: the side branch writes its input '{sorted(bad)[0]}' in place")
    window = [f for f in facts[fork:join] if f.index not in side_idx]
    if not any(f.has_call and f.self_calls for f in window):
        raise NoBranch("no main-path work between the fork and the join: nothing to overlap")

    rebound = sorted({name for f in window for name in f.stores if name in inputs})
    maybe = [name for name in outputs if any(name in f.stores for f in whole if not isinstance(f.node, cst.SimpleStatementLine))]
    phases: dict[int, int] = {}
    chosen_anchors: list[str] = []
    if phase_anchors is not None:
        chosen_anchors = list(phase_anchors) or derive_phase_anchors(facts, fork, join, side_idx)
        phases = _assign_phases(facts, whole, chosen_anchors, fork, join, side_idx, reaching_def, set(inputs))
    return SideBranch(
        phases=phases,
        phase_anchors=chosen_anchors,
        maybe_outputs=maybe,
        statements=whole,
        hoists=hoists,
        fork=fork,
        join=join,
        inputs=inputs,
        outputs=outputs,
        rebound_inputs=rebound,
        facts=facts,
    )


def _allocates(stmt: cst.BaseStatement) -> bool:
    """`name = <call>`: a buffer made for the side branch (torch.empty_like(x), x.new_empty(...))."""
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Assign)
        and isinstance(stmt.body[0].value, cst.Call)
    )



def _outer_loads(node: cst.CSTNode, is_seed: SeedPredicate) -> set[str]:
    """Names a statement reads outside its side calls (and their arguments)."""
    seeds = set(map(id, _seed_calls(node, is_seed)))

    class _Strip(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            return cst.Name("_ms_side_call") if id(original) in seeds else updated

    return node_facts(node.visit(_Strip())).loads - {"_ms_side_call"}


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


def _assign_phases(facts, whole, anchors, fork, join, side_idx, reaching_def, inputs) -> dict[int, int]:
    """Phase of each side statement: its depth in the side branch, capped at the number of anchors.

    Depth 0 reads only the fork's inputs, depth d reads a depth d-1 result: projections first,
    activations next, the rest last (the SGLang / cann-recipes three-phase split).
    """
    anchor_defs = []
    for anchor in anchors:
        d = reaching_def(anchor, join, side_idx)
        if d is None:
            raise NoBranch(f"phase anchor '{anchor}' is not assigned before the join")
        if d < fork:
            raise NoBranch(f"phase anchor '{anchor}' is ready before the side branch starts (line {facts[d].first_line})")
        if anchor_defs and d <= anchor_defs[-1]:
            raise NoBranch(f"phase anchors must come in program order ('{anchor}' is out of order)")
        anchor_defs.append(d)
    depth: dict[int, int] = {}
    for f in sorted(whole, key=lambda f: f.index):
        sources = [reaching_def(name, f.index, set()) for name in f.loads]
        depth[f.index] = 1 + max((depth[d] for d in sources if d in depth), default=-1)
    phases = {i: min(d, len(anchors)) for i, d in depth.items()}
    for f in whole:
        if phases[f.index] == 0:
            continue
        at = anchor_defs[phases[f.index] - 1] + 1
        for name in f.loads & inputs:
            if reaching_def(name, at, side_idx) != reaching_def(name, fork, side_idx):
                raise NoBranch(f"'{name}' changes between the fork and phase {phases[f.index]} at line {f.first_line}")
    return phases


def _alias_closure(
    facts: list[StatementFacts], names: set[str], upto: int, local_names: set[str] | None = None
) -> set[str]:
    """Names that may share storage with `names`: plain copies, views and slices, either way.
    Only the function's own variables alias (`torch.empty_like(x)` is not a view of `torch`)."""
    links: list[tuple[str, str]] = []
    for f in facts[:upto]:
        node = f.node
        if not isinstance(node, cst.SimpleStatementLine) or len(node.body) != 1:
            continue
        stmt = node.body[0]
        if not isinstance(stmt, cst.Assign):
            continue
        value = stmt.value
        while isinstance(value, (cst.Call, cst.Subscript, cst.Attribute)):
            value = value.func if isinstance(value, cst.Call) else value.value
        if isinstance(value, cst.Name) and value.value != "self":
            if local_names is None or value.value in local_names:
                links.extend((value.value, target) for target in f.stores)
    aliases = set(names)
    changed = True
    while changed:
        changed = False
        for a, b in links:
            if (a in aliases) != (b in aliases):
                aliases |= {a, b}
                changed = True
    return aliases


# An explicit choice of side calls (a plan from `suggest`, or one written by hand) --------------
_CONDITIONAL_EXPRESSIONS = (
    cst.IfExp, cst.BooleanOperation, cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp,
)


def find_branch_for_calls(
    func: cst.FunctionDef,
    positions: dict[cst.CSTNode, CodeRange],
    calls: list[cst.Call],
    anchors: tuple[str, ...] = (),
    phase_anchors: tuple[str, ...] | None = None,
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
    branch = find_side_branch(func, positions, is_seed, anchors=anchors, phase_anchors=phase_anchors)
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

    class _Finder(cst.CSTVisitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if isinstance(n, cst.Call) and around:
                found[id(n)] = around[-1]
            if isinstance(n, _CONDITIONAL_EXPRESSIONS):
                around.append({"IfExp": "a conditional expression", "BooleanOperation": "an and/or"}.get(
                    type(n).__name__, f"a {type(n).__name__}"))
            return True

        def on_leave(self, n: cst.CSTNode) -> None:
            if isinstance(n, _CONDITIONAL_EXPRESSIONS):
                around.pop()

    node.visit(_Finder())
    return found
