"""Carry out plans on a libcst module: the one place that edits code.

For a plan the edited function reads, top to bottom:

    <prelude: the side stream, or None when the flag is off>
    if <on>:                       # fork, as early as the side inputs allow
        <wait for the current stream>
        with <side stream>:
            <side statements>
    else:
        <side statements that were already here, unchanged>
    ... main path, untouched ...
    if <off>:
        <side statements at their original place, unchanged>
    if <on>:                       # join, right before the first consumer
        <wait for the side stream; lifetime guards>
    else:
        <side statements that sat right before the join>
    <first consumer>

With the flag off every original statement runs, in its original order, on the current stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import libcst as cst

from msrewrite.analyze.defuse import dotted_name, function_names
from msrewrite.analyze.guards import conjoin, guard_path, path_condition, rebuild_path
from msrewrite.analyze.positions import positions_for
from msrewrite.analyze.walk import Visitor
from msrewrite.emit import frameworks
from msrewrite.emit import helpers as helper_text
from msrewrite.emit.strategies import STRATEGIES, Context, Emission, Names, async_comm
from msrewrite.emit.torchair_config import record_torchair_config
from msrewrite.errors import BadInput, NothingToDo
from msrewrite.plan import MicrobatchPlan, OverlapPlan
from msrewrite.validate import comment_text, literal

_EMPTY = cst.Module(body=[])


def case_words(case_name: str, branch: str = "") -> tuple[str, str]:
    """(side work, main work) as the case's comments name them."""
    from msrewrite.cases import get_case

    case = get_case(case_name)
    if case is None:
        return ("the side branch", "the main path")
    spec = next((b for b in case.branches if b.name == branch), None)
    return (spec.what, case.what[1]) if spec is not None else case.what


def code_of(node: cst.CSTNode) -> str:
    return _EMPTY.code_for_node(node)


def strip_leading(stmt: cst.BaseStatement) -> cst.BaseStatement:
    return stmt.with_changes(leading_lines=())


# Locating functions -----------------------------------------------------------------------
@dataclass
class Located:
    """A function of the module and its enclosing class (None for a module-level function)."""

    func: cst.FunctionDef
    cls: cst.ClassDef | None


def iter_functions(module: cst.Module):
    """(qualified name, FunctionDef, enclosing ClassDef or None) for every def, classes nested."""

    def walk(body, prefix: str, cls: cst.ClassDef | None):
        for stmt in body:
            if isinstance(stmt, cst.FunctionDef):
                yield prefix + stmt.name.value, stmt, cls
            elif isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
                yield from walk(stmt.body.body, f"{prefix}{stmt.name.value}.", stmt)
            elif isinstance(stmt, (cst.If, cst.Try)) and isinstance(stmt.body, cst.IndentedBlock):
                yield from walk(stmt.body.body, prefix, cls)

    yield from walk(module.body, "", None)


def locate(module: cst.Module, qualified: str) -> Located:
    for name, func, cls in iter_functions(module):
        if name == qualified:
            return Located(func, cls)
    raise BadInput(f"no function {qualified!r} in the file")


def already_applied(func: cst.FunctionDef, marker: str | None = None) -> bool:
    """True when the function already runs side work (a second apply is a no-op): it calls
    msrewrite helpers, or, for one branch of a several-stream case, carries that branch's marker."""
    found = False

    class _Seen(Visitor):
        def visit_Name(self, node: cst.Name) -> None:
            nonlocal found
            if marker is None and node.value.startswith(helper_text.HELPER_PREFIX):
                found = True

        def visit_Comment(self, node: cst.Comment) -> None:
            nonlocal found
            if (marker or "# msrewrite(") in node.value:
                found = True

    func.visit(_Seen())
    return found


def flag_attribute(flag_name: str) -> str:
    """self.<attr> holding an env switch: ENABLE_X_STREAM -> enable_x_stream (one per switch, so
    several streams behind one switch share it)."""
    attr = re.sub(r"\W+", "_", flag_name).strip("_").lower()
    return attr if attr.startswith("enable") else f"enable_{attr}"


# Names --------------------------------------------------------------------------------------
def _identifier(tag: str) -> str:
    ident = re.sub(r"\W+", "_", tag).strip("_").lower()
    if not ident or ident[0].isdigit():
        ident = f"side_{ident}"
    return ident


def _unique(base: str, taken: set[str]) -> str:
    name, n = base, 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def _self_attrs(node: cst.CSTNode) -> set[str]:
    attrs: set[str] = set()

    class _Attrs(Visitor):
        def visit_Attribute(self, n: cst.Attribute) -> None:
            if isinstance(n.value, cst.Name) and n.value.value == "self":
                attrs.add(n.attr.value)

    node.visit(_Attrs())
    return attrs


# Statement builders ---------------------------------------------------------------------------
def _parse_block(lines: list[str]) -> list[cst.BaseStatement]:
    # A leading `pass` keeps a first comment line attached to its statement (libcst would
    # otherwise treat it as the module header).
    return list(cst.parse_module("pass\n" + "\n".join(lines) + "\n").body)[1:]


class _Splice(cst.CSTTransformer):
    """Replace placeholder statements `__ms_x__` with real statement lists."""

    def __init__(self, mapping: dict[str, list[cst.BaseStatement]]) -> None:
        self.mapping = mapping

    def leave_SimpleStatementLine(self, original, updated):
        body = updated.body
        if len(body) == 1 and isinstance(body[0], cst.Expr) and isinstance(body[0].value, cst.Name):
            key = body[0].value.value
            if key in self.mapping:
                return cst.FlattenSentinel(self.mapping[key])
        return updated


class _AsyncComm(cst.CSTTransformer):
    """`dist.send(t, dst)` -> `send_work = dist.isend(t, dst)` (recv likewise), noting the handles."""

    def __init__(self, taken: set[str]) -> None:
        self.taken = taken
        self.handles: list[tuple[str, str]] = []

    def leave_SimpleStatementLine(self, original, updated):
        if len(updated.body) != 1 or not isinstance(updated.body[0], cst.Expr):
            return updated
        call = updated.body[0].value
        if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)):
            return updated
        kind = call.func.attr.value
        if kind not in ("send", "recv"):
            return updated
        handle = _unique(f"{kind}_work", self.taken)
        self.handles.append((kind, handle))
        async_call = call.with_changes(func=call.func.with_changes(attr=cst.Name("i" + kind)))
        return updated.with_changes(
            body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(handle))], value=async_call)]
        )


class _NonBlocking(cst.CSTTransformer):
    """x.copy_(y) -> x.copy_(y, non_blocking=True): on its own stream the copy need not block the host."""

    def leave_Call(self, original, updated):
        func = updated.func
        if not (isinstance(func, cst.Attribute) and func.attr.value in ("copy_", "to")):
            return updated
        if any(arg.keyword is not None and arg.keyword.value == "non_blocking" for arg in updated.args):
            return updated
        args = list(updated.args)
        if args:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        return updated.with_changes(args=[*args, cst.Arg(
            keyword=cst.Name("non_blocking"),
            value=cst.Name("True"),
            equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
        )])


def _wrap(with_line: str, nodes: list[cst.BaseStatement], plan: OverlapPlan, label: str) -> list[cst.BaseStatement]:
    """`with <limit>:` around the main work of the overlap window (its own AI-core budget)."""
    if not nodes:
        return nodes
    lead = list(nodes[0].leading_lines)
    inner = [strip_leading(nodes[0]), *nodes[1:]]
    block = _splice(_parse_block([with_line, "    __ms_main__"]), {"__ms_main__": inner})
    note = f"msrewrite({label}): the main branch gets its own core budget while the side stream runs."
    return _with_leading(block, lead + [_comment(note)])


def _returns(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(isinstance(s, cst.Return) for s in stmt.body)


class _Rename(cst.CSTTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def leave_Name(self, original, updated):
        return updated.with_changes(value=self.new) if updated.value == self.old else updated

    def leave_Attribute(self, original, updated):
        # keep attribute names (x.old) untouched
        if updated.attr.value == self.new and original.attr.value == self.old:
            return updated.with_changes(attr=original.attr)
        return updated


def _comment(text: str) -> cst.EmptyLine:
    return cst.EmptyLine(comment=cst.Comment("# " + comment_text(text, "comment")))


def _with_leading(stmts: list[cst.BaseStatement], leading) -> list[cst.BaseStatement]:
    if not stmts:
        return stmts
    first = stmts[0]
    return [first.with_changes(leading_lines=tuple(leading) + tuple(first.leading_lines)), *stmts[1:]]


def _if_block(cond: str, on: list[cst.BaseStatement], off_cond: str | None, off: list[cst.BaseStatement]):
    """`if cond: on [else: off]`; when `on` is empty, `if off_cond: off`."""
    if not on:
        text = [f"if {off_cond}:", "    __ms_off__"]
        return _splice(_parse_block(text), {"__ms_off__": off})
    text = [f"if {cond}:", "    __ms_on__"]
    if off:
        text += ["else:", "    __ms_off__"]
    return _splice(_parse_block(text), {"__ms_on__": on, "__ms_off__": off})


def _splice(stmts: list[cst.BaseStatement], mapping) -> list[cst.BaseStatement]:
    module = cst.Module(body=stmts).visit(_Splice(mapping))
    return list(module.body)


# Guarded side branches ------------------------------------------------------------------------------
@dataclass
class _GuardedIf:
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


def _guarded_if(body, spans, positions, plan: OverlapPlan) -> _GuardedIf:
    index = _find_index(spans, plan.guard_line, "guarded if", plan)
    node = body[index]
    if not isinstance(node, cst.If) or not isinstance(node.body, cst.IndentedBlock):
        raise BadInput(f"stale plan for {plan.function}: line {plan.guard_line} is not an `if` with a block")
    first = min(s.first_line for s in plan.side)
    found = guard_path(node, lambda part: part in positions and positions[part].start.line <= first <= positions[part].end.line)
    if isinstance(found, str) or not isinstance(found[1], cst.IndentedBlock):
        raise BadInput(f"stale plan for {plan.function}: no block of the `if` at line {plan.guard_line} holds line {first}")
    expected = path_condition(found[0])
    if plan.guard != expected:  # the guard is emitted as code: it must be the `if`'s own condition
        raise BadInput(f"stale plan for {plan.function}: the `if` at line {plan.guard_line} tests {expected!r}, not {plan.guard!r}")
    return _GuardedIf(index, node, found[0], found[1])


# The transform ----------------------------------------------------------------------------------
@dataclass
class PlannedEdit:
    """One plan carried out on its function (and `__init__`): the old and new definitions."""

    plan: OverlapPlan
    old_func: cst.FunctionDef
    new_func: cst.FunctionDef
    old_init: cst.FunctionDef | None
    new_init: cst.FunctionDef | None
    emission: Emission
    cls: cst.ClassDef | None = None
    stream_param: str = ""
    # Where the edit put things in new_func's body, for schedule variants (emit/schedules.py):
    # the side statements issued at the fork (the very nodes), and [start, end) of the main work
    # between the fork block and the join block.
    side_nodes: tuple[cst.BaseStatement, ...] = ()
    window: tuple[int, int] | None = None
    # A guarded plan: `window` counts in the body with the guarded `if`'s block spliced in place
    # of the `if`; this is [start, end) of that block there, and the turns (each step's `else:`)
    # that reach it through nested `if`s and `elif`s.
    guarded_block: tuple[int, int, tuple[bool, ...]] | None = None
    # A phased plan: for each later phase, the index (counted as `window` counts) of the `if` that
    # re-enters the side stream after its anchor, and the statements it issues there (the very nodes).
    phases: tuple[tuple[int, tuple[cst.BaseStatement, ...]], ...] = ()
    # Main calls hoisted out of the join statement (plan.main_hoists): the assignments that open the
    # flag-on branch of the join block (at `window[1]`), the very nodes; main work of the window.
    main_hoisted: tuple[cst.BaseStatement, ...] = ()


def _body_positions(func: cst.FunctionDef, positions) -> list[tuple[int, int]]:
    return [
        (positions[s].start.line, positions[s].end.line) for s in func.body.body  # type: ignore[union-attr]
    ]


def _find_index(spans, line: int, what: str, plan: OverlapPlan) -> int:
    for i, (first, _last) in enumerate(spans):
        if first == line:
            return i
    raise BadInput(f"stale plan for {plan.function}: no statement starts at line {line} ({what})")


def _hoisted_calls(join: cst.BaseStatement, source: str) -> list[cst.Call]:
    """The call a hoist names in the join statement: the one occurrence, or, in an `if` whose every
    branch (an `else:` included) is one statement holding it once, the occurrence in each branch."""
    found: list[cst.Call] = []

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            if code_of(call) == source:
                found.append(call)

    join.visit(_Calls())
    if len(found) <= 1 or not isinstance(join, cst.If):
        return found if len(found) == 1 else []
    branches: list[cst.BaseSuite] = []
    current = join
    while True:
        branches.append(current.body)
        if current.orelse is None:
            return []  # no else: on that path the call never ran
        if not isinstance(current.orelse, cst.If):
            branches.append(current.orelse.body)
            break
        current = current.orelse
    per_branch = []
    for block in branches:
        inside = [c for c in found if _contains(block, c)]
        if len(inside) != 1 or not isinstance(block, cst.IndentedBlock) or len(block.body) != 1:
            return []
        per_branch += inside
    return per_branch if len(per_branch) == len(found) else []


def _split_by_phase(node: cst.BaseStatement, phases: tuple[int, ...]) -> dict[int, cst.BaseStatement] | None:
    """A side `if` (no `else`) split by the phase of each simple statement in it (source order):
    phase -> the same `if` holding only that phase's statements (nested `if`s kept where they
    still hold one). None when the `if` does not have exactly that many simple statements."""
    if not isinstance(node, cst.If):
        return None
    count = 0

    def lines(n: cst.If) -> int | None:
        total = 0
        if n.orelse is not None or not isinstance(n.body, cst.IndentedBlock):
            return None
        for stmt in n.body.body:
            if isinstance(stmt, cst.If):
                inner = lines(stmt)
                if inner is None:
                    return None
                total += inner
            elif isinstance(stmt, cst.SimpleStatementLine):
                total += 1
            else:
                return None
        return total

    count = lines(node) or 0
    if count != len(phases):
        return None

    def part(n: cst.If, wanted: int, at: list[int]) -> cst.If | None:
        kept: list[cst.BaseStatement] = []
        for stmt in n.body.body:  # type: ignore[union-attr]
            if isinstance(stmt, cst.If):
                inner = part(stmt, wanted, at)
                if inner is not None:
                    kept.append(inner)
            else:
                if phases[at[0]] == wanted:
                    kept.append(stmt)
                at[0] += 1
        if not kept:
            return None
        kept[0] = kept[0].with_changes(leading_lines=[]) if kept[0] is not n.body.body[0] else kept[0]  # type: ignore[union-attr]
        return n.with_changes(body=n.body.with_changes(body=kept))  # type: ignore[union-attr]

    out: dict[int, cst.BaseStatement] = {}
    for wanted in sorted(set(phases)):
        found = part(node, wanted, [0])
        if found is not None:
            out[wanted] = found
    return out


def _bound_on_every_path(node: cst.BaseStatement) -> set[str]:
    """Names a side statement binds to a computed value whenever it runs (an `if` binds on some
    paths only; `shared = None` binds no tensor)."""
    from msrewrite.analyze.defuse import node_facts

    if isinstance(node, cst.BaseCompoundStatement):
        return set()
    if isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1 and isinstance(node.body[0], cst.Assign):
        value = node.body[0].value
        if isinstance(value, (cst.Integer, cst.Float, cst.SimpleString)) or (
                isinstance(value, cst.Name) and value.value in ("None", "True", "False")):
            return set()
    return node_facts(node).stores


class _ReplaceCalls(cst.CSTTransformer):
    """Calls (by identity in the original tree) -> the names of their hoisted results."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        name = self.names.get(id(original))
        return cst.Name(name) if name is not None else updated


def _contains(node: cst.CSTNode, target: cst.CSTNode) -> bool:
    hit = False

    class _Find(Visitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            nonlocal hit
            hit = hit or n is target
            return not hit

    node.visit(_Find())
    return hit


def _init_info(cls: cst.ClassDef | None, flag_names: tuple[str, ...]):
    """(__init__, its config parameter, whether it already assigns any of `flag_names`)."""
    if cls is None or not isinstance(cls.body, cst.IndentedBlock):
        return None, None, False
    for stmt in cls.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
            params = [p.name.value for p in stmt.params.params]
            config = "config" if "config" in params else None
            sets_flag = bool(set(flag_names) & _assigned_self_attrs(stmt))
            return stmt, config, sets_flag
    return None, None, False


def _model_stream(cls: cst.ClassDef | None, init: cst.FunctionDef | None, plan: OverlapPlan) -> str:
    """`alt_stream` when the class already holds a side stream of the plan's API family in
    `self.alt_stream`: made in `__init__` (`torch.cuda.Stream()`, also `... if c else None`) or
    handed in as a constructor argument (`alt_stream=None`, SGLang's layers), and never
    reassigned elsewhere in the class. The edit then runs on that stream instead of a second one.
    Only the plain wait_stream modes (eager, cuda) with a lazily made stream reuse it."""
    if (cls is None or init is None or plan.mode not in ("eager", "cuda") or plan.stream_source != "lazy"
            or plan.sync != "wait_stream" or plan.core_limits or not isinstance(cls.body, cst.IndentedBlock)):
        return ""
    api = "torch.cuda" if plan.mode == "cuda" else "torch.npu"
    params = {p.name.value: p for p in (*init.params.params, *init.params.kwonly_params)}

    def is_stream(value: cst.BaseExpression) -> bool:
        if isinstance(value, cst.IfExp):
            return all(is_stream(v) or (isinstance(v, cst.Name) and v.value == "None") for v in (value.body, value.orelse)) \
                and not all(isinstance(v, cst.Name) for v in (value.body, value.orelse))
        if isinstance(value, cst.Call):
            return dotted_name(value.func) == f"{api}.Stream"
        if isinstance(value, cst.Name) and value.value in params and "stream" in value.value:
            note = params[value.value].annotation
            other = "torch.npu" if api == "torch.cuda" else "torch.cuda"
            return note is None or other not in code_of(note.annotation)
        return False

    assigned: dict[str, list[cst.BaseExpression]] = {}
    for stmt in init.body.body:  # type: ignore[union-attr]
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None:
                    targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
                    for target in targets:
                        name = dotted_name(target) or ""
                        if name.startswith("self.") and name.count(".") == 1:
                            assigned.setdefault(name[5:], []).append(small.value)
    elsewhere = set().union(*(_assigned_self_attrs(m) for m in cls.body.body
                              if isinstance(m, cst.FunctionDef) and m is not init))
    for attr, values in assigned.items():
        if "stream" in attr and attr not in elsewhere and all(is_stream(v) for v in values) \
                and not _assigned_nested(init, attr, len(values)):
            return attr
    return ""


def _assigned_nested(func: cst.FunctionDef, attr: str, top_level: int) -> bool:
    """`self.<attr>` is assigned more often than the `top_level` plain statements seen (in an `if`, a loop)."""
    count = 0

    class _Count(Visitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            nonlocal count
            count += dotted_name(node.target) == f"self.{attr}"

    func.body.visit(_Count())
    return count != top_level


def _assigned_self_attrs(func: cst.FunctionDef) -> set[str]:
    names: set[str] = set()

    class _Assigned(Visitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            t = node.target
            if isinstance(t, cst.Attribute) and isinstance(t.value, cst.Name) and t.value.value == "self":
                names.add(t.attr.value)

    func.visit(_Assigned())
    return names


def plan_edit(module: cst.Module, positions, plan: OverlapPlan, text: str | None = None) -> PlannedEdit:
    located = locate(module, plan.function)
    func, cls = located.func, located.cls
    label = plan.label
    if already_applied(func, f"msrewrite({label})" if plan.case_branch else None):
        raise NothingToDo(f"{plan.function} already runs its side branch on a side stream")
    if not isinstance(func.body, cst.IndentedBlock):
        raise BadInput(f"{plan.function}: a one-line function body cannot be split")
    compiled = frameworks.fullgraph_region(module, plan.function, text)
    if compiled is not None:
        raise BadInput(
            f"{plan.function} runs inside a torch.compile fullgraph region ({compiled}): stream code there "
            "would be traced into the graph; vLLM keeps its own stream code inside a custom op"
        )
    body = list(func.body.body)
    spans = _body_positions(func, positions)
    guarded = _guarded_if(body, spans, positions, plan) if plan.guard else None
    if guarded is not None:
        # the `if`'s block spliced in its place: the indices below are those of the flat body
        body = body[: guarded.index] + guarded.block + body[guarded.index + 1 :]
        spans = spans[: guarded.index] + [(positions[s].start.line, positions[s].end.line) for s in guarded.block] + spans[guarded.index + 1 :]
    if guarded is not None and plan.fork_line == plan.guard_line:
        fork = guarded.index
    else:
        fork = _find_index(spans, plan.fork_line, "fork", plan)
    if guarded is not None and fork > guarded.index:
        raise BadInput(f"plan for {plan.function}: a guarded side branch must fork before its `if` (line {plan.guard_line})")
    at_end = plan.join_line == spans[-1][1] + 1  # join when the function falls off its end
    join = len(body) if at_end else _find_index(spans, plan.join_line, "join", plan)

    whole: list[int] = []
    hoists: list[tuple[cst.Call, str]] = []
    also_hoisted: list[tuple[cst.Call, str]] = []  # the same call in the other branches of the join's `if`
    inner_split: dict[int, dict[int, cst.BaseStatement]] = {}  # a side `if` split over phases: phase -> its part
    phase_of: dict[int, int] = {}  # body index (or -1 - hoist number) -> phase
    for side in plan.side:
        if side.phase > len(plan.phase_anchors):
            raise BadInput(f"plan for {plan.function}: phase {side.phase} has no anchor")
        if side.hoist:
            calls = _hoisted_calls(body[join], side.source) if join < len(body) else []
            if not calls:
                raise BadInput(
                    f"stale plan for {plan.function}: the join statement at line {plan.join_line} "
                    f"does not contain {side.source!r} exactly once (or once in each branch of its `if`)"
                )
            call = calls[0]
            hoists.append((call, side.hoist))
            also_hoisted += [(other, side.hoist) for other in calls[1:]]
            phase_of[-len(hoists)] = side.phase
        else:
            i = _find_index(spans, side.first_line, "side statement", plan)
            if code_of(strip_leading(body[i])).strip() != side.source.strip():
                raise BadInput(
                    f"stale plan for {plan.function}: line {side.first_line} no longer reads {side.source.strip()!r}"
                )
            whole.append(i)
            phase_of[i] = side.phase
            if side.inner_phases:
                if not plan.phase_anchors or max(side.inner_phases) > len(plan.phase_anchors):
                    raise BadInput(f"plan for {plan.function}: line {side.first_line}: inner phases without their anchors")
                split = _split_by_phase(body[i], side.inner_phases)
                if split is None:
                    raise BadInput(
                        f"stale plan for {plan.function}: the `if` at line {side.first_line} does not hold "
                        f"{len(side.inner_phases)} statements to split into phases"
                    )
                inner_split[i] = split

    main_hoisted = _main_hoist_calls(plan, body, join, function_names(func))

    switch = flag_attribute(plan.flag.name) if plan.flag.kind in ("env", "sglang") else plan.flag.name
    roots = frameworks.imported_roots(module)
    framework_imports = frameworks.flag_imports(plan.flag, roots)
    phase_gate = None
    if plan.flag.gate is not None:
        phase_gate, needed = frameworks.phase_predicate(plan.flag.gate, func, roots, plan.function)
        framework_imports += [i for i in needed if i not in framework_imports]
    frameworks.check_own_bindings(module, framework_imports)
    init, config_param, init_sets_flag = _init_info(cls, (switch,))
    taken = function_names(func) | {temp for _call, temp in main_hoisted}
    # attributes the edit adds to the class (npugraph-ex streams/events, handed-down streams)
    needs_attrs = plan.mode == "npugraph-ex" or plan.stream_source == "constructor"
    class_attrs = _self_attrs(cls) if cls is not None and needs_attrs else set()
    ident = _identifier(plan.stream_tag)
    if plan.sync == "async-comm":
        stream_local = f"overlap_{ident}"
    elif plan.mode == "ge-graph":
        stream_local = f"use_{ident}_stream"
    else:
        stream_local = f"{ident}_stream"
    names = Names(
        stream=_unique(stream_local, taken),
        current=_unique("current_stream", taken),
        fork_event=_unique("fork_event", taken),
        join_event=_unique("join_event", taken),
        flag_attr=flag_attribute(plan.flag.name),
        stream_attr=_unique(f"{ident}_stream", set(class_attrs)),
        events_attr=_unique(f"{ident}_events", set(class_attrs)),
        input_ready=_unique("input_ready_event", taken),
        side_done=_unique(f"{ident}_done_event", taken),
    )
    what, _main = case_words(plan.case, plan.case_branch)

    # GE start gates rebind the gated tensor; rename it inside the side block when the main
    # path still reads the original name, so main work is not ordered after the anchor too.
    gates: list[tuple[str, str, str]] = []
    renames: dict[str, str] = {}
    main_reads: set[str] = set()
    for i, stmt in enumerate(body):
        if plan.start_gates and i >= fork and i not in whole:
            main_reads |= function_names(stmt)
    # --protect clone: the side stream reads a snapshot of each input the main path writes
    # before the join, taken on the main stream before the fork.
    snapshots: dict[str, str] = {}
    if plan.protect_inputs and plan.start_gates:
        raise BadInput(f"plan for {plan.function}: --protect clone and --start-after cannot be combined")
    for name in plan.protect_inputs:
        snapshots[name] = _unique(f"{name}_side", taken)
    for gate in plan.start_gates:
        side_name = gate.tensor
        if gate.tensor in main_reads:
            side_name = _unique(f"{gate.tensor}_side", taken)
            renames[gate.tensor] = side_name
        gates.append((side_name, gate.tensor, gate.anchor))

    model_stream = _model_stream(cls, init, plan)  # an attribute name read from the class's __init__
    ctx = Context(
        case=plan.case,
        tag=plan.stream_tag,
        flag_kind=plan.flag.kind,
        flag_name=plan.flag.name,
        flag_default=plan.flag.default,
        max_tokens=plan.flag.max_tokens,
        has_init=init is not None,
        init_config_param=config_param,
        init_sets_flag=init_sets_flag,
        inputs=[snapshots.get(n, n) for n in plan.side_inputs],
        rebound_inputs=[n for n in plan.inputs_rebound_before_join if n not in snapshots],
        outputs=list(plan.side_outputs),
        maybe_unbound=list(plan.outputs_maybe_unbound),
        token_input=plan.side_inputs[0] if plan.side_inputs else None,
        gates=gates if plan.mode == "ge-graph" else [],
        names=names,
        what=what,
        stream_source=plan.stream_source,
        sync=plan.sync,
        phased=bool(plan.phase_anchors),
        core_limits=plan.core_limits,
        phase_gate=phase_gate,
        framework_imports=framework_imports,
        model_stream=model_stream,
    )
    em = async_comm(ctx) if plan.sync == "async-comm" else STRATEGIES[plan.mode](ctx)
    if main_hoisted and em.main_limit:
        raise BadInput(f"plan for {plan.function}: core limits on main work hoisted out of the join statement are not supported")
    if guarded is not None:
        if em.main_limit:
            raise BadInput(f"plan for {plan.function}: core limits on a guarded side branch are not supported")
        if any(i not in guarded.inside for i in whole):
            raise BadInput(f"plan for {plan.function}: a guarded side statement lies outside its `if` (line {plan.guard_line})")

    # Side statements as they run on the side stream, by phase (0 = at the fork).
    hoist_assigns = [
        cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(temp))], value=call)])
        for call, temp in hoists
    ]
    phase_nodes: dict[int, list[cst.BaseStatement]] = {}
    for i in whole:
        if i in inner_split:
            for p, part in sorted(inner_split[i].items()):
                phase_nodes.setdefault(p, []).append(strip_leading(part))
        else:
            phase_nodes.setdefault(phase_of[i], []).append(strip_leading(body[i]))
    for k, assign in enumerate(hoist_assigns, start=1):
        phase_nodes.setdefault(phase_of[-k], []).append(assign)
    for old, new in snapshots.items():
        phase_nodes = {p: [s.visit(_Rename(old, new)) for s in nodes] for p, nodes in phase_nodes.items()}
    if plan.mode == "ge-graph":
        for old, new in renames.items():
            phase_nodes = {p: [s.visit(_Rename(old, new)) for s in nodes] for p, nodes in phase_nodes.items()}
    if plan.non_blocking:
        phase_nodes = {p: [n.visit(_NonBlocking()) for n in nodes] for p, nodes in phase_nodes.items()}
    handles: list[tuple[str, str]] = []  # (kind, name) of the async transfers, in issue order
    if em.async_comm:
        made = _AsyncComm(taken)
        phase_nodes = {p: [n.visit(made) for n in nodes] for p, nodes in phase_nodes.items()}
        handles = made.handles
        recvs = [h for kind, h in handles if kind == "recv"]
        sends = [h for kind, h in handles if kind == "send"]
        em.join = [f"{h}.wait()" for h in recvs + sends]
    side_nodes = phase_nodes.get(0, [])
    phase_blocks, phase_issued = _phase_blocks(plan, em, body, positions, join, phase_nodes, taken, what, guarded)
    phases: list[tuple[int, tuple[cst.BaseStatement, ...]]] = []

    # Runs of side statements left at their original place (they form the off path).
    runs: list[list[int]] = []
    for i in sorted(whole):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    # a guarded plan's fork sits before the `if`; the side statements stay in it
    fork_run = next((r for r in runs if r[0] == fork), None) if guarded is None else None
    join_run = next((r for r in runs if r[-1] == join - 1 and r is not fork_run), None)
    join_guard = ""  # a join after a guarded `if` runs under its condition too
    if guarded is not None:
        if join not in guarded.inside:
            join_run = None
            join_guard = plan.guard

    def off_nodes(run: list[int] | None) -> list[cst.BaseStatement]:
        if not run:
            return []
        nodes = [body[i] for i in run]
        return [strip_leading(nodes[0]), *nodes[1:]]

    # Fork block.
    inner = [*_parse_block(em.side_head), *side_nodes, *_parse_block(em.side_tail)] if (
        em.side_head or em.side_tail
    ) else side_nodes
    with_stmt = (
        _splice(_parse_block([em.with_open, "    __ms_side__"]), {"__ms_side__": inner}) if em.with_open else inner
    )
    clones = _parse_block([f"{new} = {old}.clone()" for old, new in snapshots.items()])
    if clones:
        note = (f"msrewrite({label}): the main path may write {', '.join(snapshots)} before the join: "
                "the side stream reads a copy.")
        clones = _with_leading(clones, [_comment(note)])
    on_branch = [*clones, *_parse_block(em.on_head), *with_stmt]
    # The prelude (stream or switch) must precede every use of it: the fork, or an earlier side
    # statement whose original place now holds its off-path guard.
    prelude_at = min([fork, *whole])
    opening = (
        f"msrewrite({label}): {what} start as soon as their tensors exist, overlapping {_main}."
        if em.async_comm
        else f"msrewrite({label}): {what} runs on the model's own side stream self.{ctx.model_stream} during {_main}."
        if ctx.model_stream
        else f"msrewrite({label}): {what} runs on side stream {literal(plan.stream_tag)} during {_main}."
    )
    notes = [_comment(opening)]
    if plan.guard:
        notes.append(
            _comment(f"Only when {plan.guard}, as in the `if` below; nothing in between can change that.")
        )
    prelude = _with_leading(_parse_block(em.prelude), notes)
    fork_cond = conjoin(em.on_cond, plan.guard) if plan.guard else em.on_cond
    fork_block = _if_block(fork_cond, on_branch, em.off_cond, off_nodes(fork_run))
    if prelude_at == fork:
        fork_block = prelude + fork_block
    if fork_run:
        fork_block = _with_leading(fork_block, list(body[fork].leading_lines))

    # Join block.
    join_off = off_nodes(join_run) + hoist_assigns  # the off path computes what the join reads, as before
    join_on = _parse_block(em.join) if em.join else []
    join_cond = conjoin(em.on_cond, join_guard) if join_guard else em.on_cond
    join_block = _if_block(join_cond, join_on, em.off_cond, join_off) if (join_on or join_off) else []
    join_stmt = body[join] if join < len(body) else cst.SimpleStatementLine(body=[cst.Pass()])
    main_assigns = [
        cst.SimpleStatementLine(body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(temp))], value=call)])
        for call, temp in main_hoisted
    ]
    if hoists or main_hoisted:  # every hoisted call in one pass (a deep_replace rebuilds the tree, losing the others)
        join_stmt = join_stmt.visit(_ReplaceCalls({id(call): temp for call, temp in [*hoists, *also_hoisted, *main_hoisted]}))
    if main_hoisted:
        # The main calls run first on the flag-on path only, into their temporaries, overlapping the
        # side work; the join statement then reads them. The flag-off path keeps the statements
        # as they were, in their order (the side statements right before the join included).
        original = body[join]
        on_stmt = strip_leading(join_stmt)
        off = off_nodes(join_run)
        off.append(original if off else strip_leading(original))
        join_block = _if_block(join_cond, [*main_assigns, *join_on, on_stmt], em.off_cond, off)
        join_stmt = None
    if join_block and main_hoisted:
        lead = list(body[join_run[0]].leading_lines) if join_run else list(body[join].leading_lines)
        main_names = ", ".join(dict.fromkeys(code_of(call.func) for call, _temp in main_hoisted))
        notes = [f"msrewrite({label}): with the flag on, {main_names} runs here, during {what}"
                 + (", then" if join_on else ".")]
        if join_on:
            notes.append(f"the side stream is joined before the first use of {', '.join(plan.side_outputs)}.")
        join_block = _with_leading(join_block, lead + [_comment(n) for n in notes])
    elif join_block:
        if join_run:
            lead = list(body[join_run[0]].leading_lines)
        elif all(line.comment is None for line in join_stmt.leading_lines):
            lead = list(join_stmt.leading_lines)
            join_stmt = strip_leading(join_stmt)
        else:
            lead = []
        if join_on and plan.side_outputs and not em.async_comm:
            note = (
                f"msrewrite({label}): join the side stream before the first use of "
                f"{', '.join(plan.side_outputs)}."
            )
        elif join_on and em.async_comm:
            note = f"msrewrite({label}): wait for the transfers before their first use."
        elif join_on:
            where = "before returning" if join == len(body) or _returns(join_stmt) else "here"
            note = f"msrewrite({label}): {what} must finish before its buffers are reused: join {where}."
        else:
            note = f"msrewrite({label}): with the flag off {what} runs here, as before."
        join_block = _with_leading(join_block, lead + [_comment(note)])

    new_body: list[cst.BaseStatement] = []
    window_start: int | None = None  # where the main work between fork and join begins in new_body
    window_end: int | None = None
    in_fork_or_join = set(fork_run or []) | set(join_run or [])
    block_start = block_end = None  # where the guarded `if`'s block lies in new_body
    for i, stmt in enumerate(body):
        if guarded is not None and i == guarded.index + len(guarded.block):
            block_end = len(new_body)
        if i == join and window_start is not None and em.main_limit:
            new_body[window_start:] = _wrap(em.main_limit, new_body[window_start:], plan, label)
        if i == prelude_at and prelude_at != fork:
            new_body += _with_leading(prelude, list(stmt.leading_lines))
            stmt = strip_leading(stmt)
            body[i] = stmt
        if i == fork:
            new_body += fork_block
            window_start = len(new_body)
        if guarded is not None and i == guarded.index:
            block_start = len(new_body)
        if i in whole:
            if i in in_fork_or_join:
                continue
            run = next(r for r in runs if i in r)
            if i == run[0]:
                guard = _if_block(em.off_cond, [], em.off_cond, off_nodes(run))
                new_body += _with_leading(guard, list(body[i].leading_lines))
            continue
        if i == join:
            window_end = len(new_body)
            new_body += join_block
            if join_stmt is not None:
                new_body.append(join_stmt)
            continue
        new_body.append(stmt)
        if i in phase_blocks:
            phases.append((len(new_body), phase_issued[i]))
            new_body += phase_blocks[i]
    block_end = len(new_body) if block_end is None else block_end
    if join == len(body):
        if window_start is not None and em.main_limit:
            new_body[window_start:] = _wrap(em.main_limit, new_body[window_start:], plan, label)
        window_end = len(new_body)
        new_body += join_block
    guarded_block = None
    if guarded is not None:  # the block goes back into its `if` (window and side nodes count without it)
        new_body[block_start:block_end] = [guarded.rebuild(new_body[block_start:block_end])]
        guarded_block = (block_start, block_end, tuple(in_orelse for _node, in_orelse in guarded.path))
    new_func = func.with_changes(body=func.body.with_changes(body=new_body))

    new_init = None
    if init is not None and em.init_lines:
        init_stmts = _parse_block(em.init_lines)
        new_init = init.with_changes(
            body=init.body.with_changes(body=[*init.body.body, *init_stmts])  # type: ignore[union-attr]
        )
        if plan.stream_source == "constructor":
            new_init = _add_keyword_param(new_init, names.stream_attr)
    window = (window_start, window_end) if window_start is not None and window_end is not None else None
    return PlannedEdit(
        plan, func, new_func, init, new_init, em, cls, names.stream_attr, tuple(side_nodes), window, guarded_block,
        tuple(phases), tuple(main_assigns),
    )


def _main_hoist_calls(
    plan: OverlapPlan, body: list[cst.BaseStatement], join: int, taken: set[str]
) -> list[tuple[cst.Call, str]]:
    """(call, temporary) of each main call the plan hoists out of the join statement, found there
    by its text (exactly once: the join statement is one simple statement)."""
    if not plan.main_hoists:
        return []
    if join >= len(body) or not isinstance(body[join], cst.SimpleStatementLine) or len(body[join].body) != 1:
        raise BadInput(
            f"stale plan for {plan.function}: main work is hoisted out of the join at line {plan.join_line}, "
            "which is not one simple statement"
        )
    taken = taken | {s.hoist for s in plan.side if s.hoist}
    found: list[tuple[cst.Call, str]] = []
    for hoist in plan.main_hoists:
        calls = _hoisted_calls(body[join], hoist.source)
        if len(calls) != 1:
            raise BadInput(
                f"stale plan for {plan.function}: the join statement at line {plan.join_line} "
                f"does not contain {hoist.source!r} exactly once"
            )
        if hoist.hoist in taken:
            raise BadInput(f"plan for {plan.function}: main hoist temporary {hoist.hoist!r} is a name the function already uses")
        taken.add(hoist.hoist)  # type: ignore[arg-type]
        found.append((calls[0], hoist.hoist))  # type: ignore[arg-type]
    inner = [a for a, _ in found for b, _ in found if a is not b and _contains(b, a)]
    if inner:
        raise BadInput(f"plan for {plan.function}: main hoist {code_of(inner[0])!r} sits inside another one")
    return found


def _phase_blocks(plan, em, body, positions, join, phase_nodes, taken, what, guarded=None):
    """body index of each phase's anchor -> the block that re-enters the side stream after it, and
    -> the statements that block issues on the side stream (for schedule variants)."""
    from msrewrite.analyze.defuse import node_facts, statement_facts

    if not plan.phase_anchors:
        return {}, {}
    facts = statement_facts(body, positions)
    blocks: dict[int, list[cst.BaseStatement]] = {}
    issued: dict[int, tuple[cst.BaseStatement, ...]] = {}
    earlier: set[str] = set()  # names the side stream defined in earlier phases, on every path
    for nodes in [phase_nodes.get(0, [])]:
        for node in nodes:
            earlier |= _bound_on_every_path(node)
    for p, anchor in enumerate(plan.phase_anchors, start=1):
        at = next((f.index for f in reversed(facts[:join]) if anchor in f.stores), None)
        if at is None:
            raise BadInput(f"stale plan for {plan.function}: phase anchor {anchor!r} is not assigned before the join")
        nodes = phase_nodes.get(p, [])
        if not nodes:
            continue
        inner = list(nodes)
        if em.phase_gate:
            # the gated tensor must be bound wherever the phase runs: one an earlier phase bound on
            # every path (not inside a side `if`), else a side input (bound before the fork)
            loads = [n for node in nodes for n in sorted(node_facts(node).loads)]
            inputs = [n for n in loads if n in plan.side_inputs]
            tensor = next((n for n in loads if n in earlier), inputs[0] if inputs else None)
            if tensor is not None:
                side_name = tensor if tensor in earlier else _unique(f"{tensor}_phase{p}", taken)
                if side_name != tensor:
                    inner = [node.visit(_Rename(tensor, side_name)) for node in inner]
                gate = em.phase_gate.format(side=side_name, tensor=tensor, anchor=anchor)
                inner = [*_parse_block([gate]), *inner]
        for node in nodes:
            earlier |= _bound_on_every_path(node)
        with_stmt = (
        _splice(_parse_block([em.with_open, "    __ms_side__"]), {"__ms_side__": inner}) if em.with_open else inner
    )
        # a phase re-entered before the guarded `if` runs under its condition too
        cond = conjoin(em.on_cond, plan.guard) if guarded is not None and at not in guarded.inside else em.on_cond
        block = _if_block(cond, [*_parse_block(em.phase_head), *with_stmt], em.off_cond, [])
        note = f"msrewrite({plan.case}): phase {p} of {what} re-enters the side stream after {anchor}."
        blocks[at] = _with_leading(block, [_comment(note)])
        issued[at] = tuple(inner)
    return blocks, issued


class _ReplaceFunctions(cst.CSTTransformer):
    """Swap function definitions by identity in the original tree, all in one pass, descending
    only into the statements that hold them (the rest of the module is left untouched)."""

    def __init__(self, module: cst.Module, replacements: dict[int, cst.FunctionDef]) -> None:
        self.replacements = replacements
        self.ancestors: set[int] = set()

        def mark(body, path: list[cst.CSTNode]) -> None:
            for stmt in body:
                if id(stmt) in replacements:
                    self.ancestors.update(id(node) for node in path)
                inner = getattr(stmt, "body", None)
                if isinstance(stmt, (cst.ClassDef, cst.If, cst.Try)) and isinstance(inner, cst.IndentedBlock):
                    mark(inner.body, [*path, stmt, inner])

        mark(module.body, [module])

    def on_visit(self, node: cst.CSTNode) -> bool:
        return id(node) in self.ancestors

    def on_leave(self, original, updated):
        if isinstance(original, cst.FunctionDef):
            return self.replacements.get(id(original), updated)
        return updated


# Constructor plumbing -------------------------------------------------------------------------
def _add_keyword_param(func: cst.FunctionDef, name: str, default: str = "None") -> cst.FunctionDef:
    """`def __init__(..., name=None)`: keyword-only after *args, else the last positional one."""
    params = func.params
    existing = [p.name.value for p in (*params.params, *params.kwonly_params)]
    if name in existing:
        return func
    param = cst.Param(
        name=cst.Name(name),
        default=cst.parse_expression(default),
        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
    )
    if isinstance(params.star_arg, cst.Param) or params.kwonly_params:
        return func.with_changes(params=params.with_changes(kwonly_params=[*params.kwonly_params, param]))
    items = list(params.params)
    if items and items[-1].comma is cst.MaybeSentinel.DEFAULT and params.star_kwarg is None:
        items[-1] = items[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    if params.star_kwarg is not None:
        param = param.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        if items and items[-1].comma is cst.MaybeSentinel.DEFAULT:
            items[-1] = items[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return func.with_changes(params=params.with_changes(params=[*items, param]))


def _class_inits(module: cst.Module) -> dict[str, cst.FunctionDef]:
    inits: dict[str, cst.FunctionDef] = {}
    for name, func, cls in iter_functions(module):
        if cls is not None and func.name.value == "__init__":
            inits[cls.name.value] = func
    return inits


def _constructed_classes(func: cst.CSTNode, names: set[str]) -> set[str]:
    """The classes among `names` that `func` (or any node) calls, i.e. constructs."""
    found: set[str] = set()

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            if isinstance(call.func, cst.Name) and call.func.value in names:
                found.add(call.func.value)

    func.visit(_Calls())
    return found


def plumb_constructor_stream(module: cst.Module, target: str, param: str, plan: OverlapPlan, em: Emission) -> cst.Module:
    """Hand the side stream down from the outermost class in the file that builds `target`.

    Every class on the way gets a `param=None` keyword and passes it on; the outermost one (built
    nowhere in this file) creates the stream once, before the statement that builds its layers.
    """
    inits = _class_inits(module)
    builds = {cls: _constructed_classes(func, set(inits)) for cls, func in inits.items()}
    built_somewhere = {name for names in builds.values() for name in names}
    receivers, creators, frontier = {target}, set(), [target]
    while frontier:
        callee = frontier.pop()
        for cls, names in builds.items():
            if callee not in names or cls == callee:
                continue
            if cls in built_somewhere and cls not in receivers:
                receivers.add(cls)
                frontier.append(cls)
            elif cls not in built_somewhere:
                creators.add(cls)
    flag_line = _creator_flag(plan, em)
    return module.visit(_Plumb(receivers, creators, target, param, plan.stream_tag, flag_line, plan.case))


def _creator_flag(plan: OverlapPlan, em: Emission) -> str:
    default = "True" if plan.flag.default else "False"
    if plan.flag.kind == "env":
        return f"_ms_env_flag({literal(plan.flag.name)}, {default})"
    if plan.flag.kind == "sglang":
        return f"get_bool_env_var({literal(plan.flag.name)}, {literal(default.lower())})"
    if plan.flag.kind == "vllm-ascend":
        return f"getattr(get_ascend_config(), {literal(plan.flag.name)}, {default})"
    return f"getattr(config, {literal(plan.flag.name)}, {default})"


class _Plumb(cst.CSTTransformer):
    def __init__(self, receivers, creators, target, param, tag, flag, case) -> None:
        self.receivers, self.creators, self.target = receivers, creators, target
        self.param, self.tag, self.flag, self.case = param, tag, flag, case
        self.classes: list[str] = []
        self.in_init = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node.name.value)

    def leave_ClassDef(self, original, updated):
        self.classes.pop()
        return updated

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.in_init = bool(self.classes) and node.name.value == "__init__"

    def leave_Call(self, original, updated):
        cls = self.classes[-1] if self.classes else None
        if not self.in_init or cls not in (self.receivers | self.creators) - {self.target}:
            return updated
        if not (isinstance(updated.func, cst.Name) and updated.func.value in self.receivers):
            return updated
        if any(arg.keyword is not None and arg.keyword.value == self.param for arg in updated.args):
            return updated
        args = list(updated.args)
        if args and args[-1].comma is cst.MaybeSentinel.DEFAULT:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        arg = cst.Arg(
            keyword=cst.Name(self.param),
            value=cst.Name(self.param),
            equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")),
        )
        return updated.with_changes(args=[*args, arg])

    def leave_FunctionDef(self, original, updated):
        cls = self.classes[-1] if self.classes else None
        if not (self.classes and updated.name.value == "__init__"):
            return updated
        self.in_init = False
        if cls in self.receivers and cls != self.target:
            return _add_keyword_param(updated, self.param)
        if cls in self.creators:
            body = list(updated.body.body)
            at = next((i for i, stmt in enumerate(body) if _constructed_classes(stmt, self.receivers)), None)
            if at is None:
                return updated
            create = _parse_block([
                f"# msrewrite({self.case}): one side stream for every layer, created once with the model.",
                f"{self.param} = _ms_side_stream({literal(self.tag)}, {self.flag})",
            ])
            create = _with_leading(create, list(body[at].leading_lines))
            body[at] = strip_leading(body[at])
            body[at:at] = create
            return updated.with_changes(body=updated.body.with_changes(body=body))
        return updated




# Module level: helpers and imports ------------------------------------------------------------------
def _is_import(stmt: cst.BaseStatement) -> bool:
    if isinstance(stmt, cst.SimpleStatementLine):
        return all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)
    if isinstance(stmt, cst.Try) and isinstance(stmt.body, cst.IndentedBlock):
        return all(_is_import(s) for s in stmt.body.body)
    return False


def _is_future(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and any(isinstance(s, cst.ImportFrom) and code_of(s.module or cst.Name("")) == "__future__" for s in stmt.body)
    )


def _top_level_bindings(module: cst.Module) -> set[str]:
    bound: set[str] = set()
    for stmt in module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            bound.add(stmt.name.value)
        elif _is_import(stmt):
            for node in ([stmt] if isinstance(stmt, cst.SimpleStatementLine) else stmt.body.body):  # type: ignore
                for imp in node.body:  # type: ignore[union-attr]
                    if isinstance(imp.names, cst.ImportStar):
                        continue
                    for alias in imp.names:
                        if alias.asname is not None:
                            bound.add(code_of(alias.asname.name))
                        else:
                            bound.add(code_of(alias.name).split(".")[0])
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Assign):
                    for t in small.targets:
                        if isinstance(t.target, cst.Name):
                            bound.add(t.target.value)
    return bound


def _imports_module(module: cst.Module, name: str) -> bool:
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for imp in stmt.body:
                if isinstance(imp, cst.Import):
                    for alias in imp.names:
                        if code_of(alias.name) == name and alias.asname is None:
                            return True
    return False


def _from_import_of(stmt: cst.BaseStatement, module: str) -> bool:
    """A one-line `from <module> import a, b` (no parentheses, no star) that a name can join."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
        return False
    imp = stmt.body[0]
    return (isinstance(imp, cst.ImportFrom) and not imp.relative and imp.module is not None
            and code_of(imp.module) == module and not isinstance(imp.names, cst.ImportStar)
            and imp.lpar is None and stmt.trailing_whitespace.comment is None)


def add_helpers(module: cst.Module, emissions: list[Emission], mode: str) -> cst.Module:
    keys: list[str] = []
    imports: list[str] = []
    stdlib: list[str] = []
    from_imports: list[tuple[str, str]] = []
    for em in emissions:
        from_imports += [i for i in em.from_imports if i not in from_imports]
        keys += [k for k in em.helpers if k not in keys]
        imports += [i for i in em.imports if i not in imports]
        stdlib += [name for name in (["os"] if em.needs_os else []) + em.stdlib if name not in stdlib]
    if "_ms_torchair_config" in keys:
        module = record_torchair_config(module)
    bound = _top_level_bindings(module)
    for key in keys:
        name = helper_text.defined_name(key)
        if name in bound and key in helper_text.FUNCTIONS:
            existing = next(
                s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == name
            )
            if code_of(strip_leading(existing)).strip() != helper_text.FUNCTIONS[key].strip():
                raise BadInput(
                    f"the file already has {name}() for another execution mode; "
                    f"msrewrite never mixes API families in one file (asked for {mode})"
                )
    missing = [k for k in helper_text.FUNCTIONS if k in keys and helper_text.defined_name(k) not in bound]
    parts: list[str] = []
    for imp in imports:
        if imp not in bound:
            parts.append(helper_text.GUARDED_IMPORTS[imp])
    if any(k.startswith("_ms_side_stream") for k in missing) and "_MS_SIDE_STREAMS" not in bound:
        parts.append(helper_text.STREAM_CACHE)
    if missing:
        parts.append(helper_text.helper_source(missing))
    body = list(module.body)
    if parts:
        helpers = "\n\n".join(p.rstrip("\n") + "\n" for p in parts)
        # in the file's own line endings: a multi-line docstring keeps its newlines as written
        block = list(cst.parse_module(helpers.replace("\n", module.default_newline)).body)
        block = [
            s.with_changes(leading_lines=[cst.EmptyLine()] * (2 if isinstance(s, cst.FunctionDef) else 1))
            if i
            else s
            for i, s in enumerate(block)
        ]
        existing_helper = [
            i for i, s in enumerate(body)
            if isinstance(s, cst.FunctionDef) and s.name.value.startswith(helper_text.HELPER_PREFIX)
        ]
        if existing_helper:
            at = existing_helper[-1] + 1
            block[0] = block[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        else:
            at = 0
            for i, stmt in enumerate(body):
                if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                    break
                if _is_import(stmt):
                    at = i + 1
            block[0] = block[0].with_changes(
                leading_lines=[
                    cst.EmptyLine(),
                    _comment(f"msrewrite: multi-stream helpers ({mode} mode). With the flag off, or without"),
                    _comment("the backend, each one falls back to the original single-stream behaviour."),
                ]
            )
        if at < len(body):
            following = body[at]
            blank = sum(1 for line in following.leading_lines if line.comment is None and not line.whitespace.value)
            lead = list(following.leading_lines)
            if blank < 2 and isinstance(block[-1], cst.FunctionDef):
                lead = [cst.EmptyLine()] * (2 - blank) + lead
                body[at] = following.with_changes(leading_lines=lead)
        body[at:at] = block
    # the framework's own names, imported as its model files do, after the file's last import
    new_from = [(mod, name) for mod, name in from_imports if name not in bound]
    for mod, name in new_from:
        same = next((i for i, s in enumerate(body) if _from_import_of(s, mod)), None)
        if same is not None:  # `from M import a` becomes `from M import a, name`
            line = body[same]
            imp = line.body[0]
            comma = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            names = [*imp.names[:-1], imp.names[-1].with_changes(comma=comma), cst.ImportAlias(cst.Name(name))]
            body[same] = line.with_changes(body=[imp.with_changes(names=names)])
            continue
        plain = [i for i, s in enumerate(body) if isinstance(s, cst.SimpleStatementLine) and _is_import(s)]
        at = plain[-1] + 1 if plain else 0
        body.insert(at, cst.parse_statement(f"from {mod} import {name}\n"))
    for name in sorted(stdlib, reverse=True):  # each lands first: the final order is sorted
        if name in bound or _imports_module(module, name):
            continue
        at = next((i for i, s in enumerate(body) if _is_import(s) and not _is_future(s)), None)
        new_import = cst.parse_statement(f"import {name}\n")
        if at is None:
            at = next((i + 1 for i, s in enumerate(body) if _is_future(s)), 0)
            body.insert(at, new_import)
        else:
            # take over the first import's leading comments/blank lines so they stay on top
            first = body[at]
            body[at] = strip_leading(first)
            body.insert(at, new_import.with_changes(leading_lines=first.leading_lines))
    return module.with_changes(body=body)


def apply_plans(
    module: cst.Module, plans: list[OverlapPlan], text: str | None = None,
    reschedule: Callable[[PlannedEdit], cst.FunctionDef] | None = None,
) -> cst.Module:
    """The module with every plan carried out; plans address the given (unedited) module's lines.
    `reschedule` (verify's schedule variants) returns the edited function with its side work moved."""
    if not plans:
        return module
    micro = [p for p in plans if isinstance(p, MicrobatchPlan)]
    if micro:  # a model-level fork (prefill-microbatch): its own emitter, and alone
        if len(plans) > 1 or reschedule is not None:
            raise BadInput("a prefill-microbatch plan forks the whole model: carry it out alone (--candidate N)")
        from msrewrite.emit.microbatch import microbatch_edit

        return microbatch_edit(module, micro[0], text)
    modes = {p.mode for p in plans}
    if len(modes) > 1:
        raise BadInput(f"plans for one file must share one execution mode, got {', '.join(sorted(modes))}")
    edits = []
    for plan in plans:
        located = locate(module, plan.function)
        edits.append(plan_edit(module, positions_for(module, plan.function, located.func, text), plan, text))
        if reschedule is not None:
            edits[-1].new_func = reschedule(edits[-1])
    functions = [e.old_func for e in edits]
    if len(set(map(id, functions))) != len(functions):
        raise BadInput("two plans edit the same function; apply them one at a time")
    replacements: dict[int, cst.FunctionDef] = {id(e.old_func): e.new_func for e in edits}
    for edit in edits:
        if edit.old_init is not None and edit.new_init is not None:
            added = edit.new_init.body.body[len(edit.old_init.body.body):]  # type: ignore[union-attr]
            base = replacements.get(id(edit.old_init), edit.old_init)
            replacements[id(edit.old_init)] = base.with_changes(
                params=edit.new_init.params if edit.new_init.params is not edit.old_init.params else base.params,
                body=base.body.with_changes(body=[*base.body.body, *added]),  # type: ignore[union-attr]
            )
    new = module.visit(_ReplaceFunctions(module, replacements))
    for edit in edits:
        if edit.plan.stream_source == "constructor" and edit.cls is not None and edit.new_init is not None:
            new = plumb_constructor_stream(new, edit.cls.name.value, edit.stream_param, edit.plan, edit.emission)
    new = add_helpers(new, [e.emission for e in edits], plans[0].mode)
    if any(p.markers for p in plans):  # apply --markers: profiler ranges, added by a pass of their own
        from msrewrite.emit import markers

        new = cst.parse_module(markers.add(new.code, [p for p in plans if p.markers]))
    return new
