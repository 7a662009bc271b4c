"""Prefill micro-batching's analysis: the model's layer loop, the layer it runs, and the layer's
stages at its collectives, as a MicrobatchPlan (msrewrite/plan.py) that emit/microbatch.py
carries out.

A layer's forward is split into alternating compute and comm stages at its collectives
(`dist.all_reduce`, `all_to_all`, a named dispatch/combine helper, or, through the file's
summaries, a call one module deeper whose forward holds one). The plan is refused, with the
reason, where two micro-batches could not run the layer one stage apart without changing results:
a collective under control flow in a submodule (it could be issued a different number of times
per micro-batch), a compute statement calling something msrewrite cannot see into (a collective
hidden there would run on the compute stream, out of order with the comm stream), or a statement
that writes state both micro-batches share (an attribute of the layer, a global): each micro-batch
would write it, one beside the other's comm stage.

`apply --plan` re-derives the plan from the file with the same options and carries it out only
when it is the plan the analysis makes (`check_microbatch_plan`).
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst

from msrewrite import validate
from msrewrite.analyze.definitions import kept_method
from msrewrite.analyze.defuse import all_calls, dotted_name, node_facts
from msrewrite.analyze.positions import positions_for
from msrewrite.analyze.torch_effects import torch_call_effect
from msrewrite.analyze.walk import Visitor
from msrewrite.errors import BadInput, NothingToDo
from msrewrite.plan import FlagSpec, MicrobatchPlan, MicrobatchStage, SourceSpan, microbatch_flag_error
from msrewrite.records import record


class NotApplicable(NothingToDo):
    """No micro-batch fork to make here (no layer loop, no collective, a layer shape the fork does
    not handle), as opposed to a refusal: `suggest` lists only refusals."""


COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_to_all",
        "all_to_all_single",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "reduce",
    }
)
COMM_HELPER_WORDS = ("dispatch", "combine", "all_to_all")


def is_collective(call: cst.Call) -> bool:
    module, _, name = (dotted_name(call.func) or "").rpartition(".")
    if module in ("dist", "torch.distributed") and name in COLLECTIVES:
        return True
    return any(word in name for word in COMM_HELPER_WORDS)  # named comm helpers


def _has_collective(node: cst.CSTNode) -> bool:
    return any(is_collective(call) for call in all_calls(node))


def _code(node: cst.CSTNode) -> str:
    return cst.Module(body=[]).code_for_node(node)


def statement_source(stmt: cst.BaseStatement | cst.BaseSmallStatement) -> str:
    """A statement's text without its leading comments and blank lines (what a plan keeps)."""
    if isinstance(stmt, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
        stmt = stmt.with_changes(leading_lines=())
    return _code(stmt).strip()


def _indented(func: cst.FunctionDef) -> list[cst.BaseStatement]:
    """The statements of a function's indented body ([] for a one-line body)."""
    return list(func.body.body) if isinstance(func.body, cst.IndentedBlock) else []


@record
class Stage:
    comm: bool
    statements: list[cst.BaseStatement]


def stages_of(func: cst.FunctionDef, deep: DeepCollectives | None = None) -> list[Stage]:
    """The layer's statements grouped into alternating compute and comm stages. With `deep` (the
    file's summaries), a statement whose call holds a collective one module deeper (`self.moe(x)`)
    is a comm stage as a whole."""
    # a one-line body holds no statement lines: refused below as any other body would be
    body = _indented(func)
    if not body or not all(isinstance(s, cst.SimpleStatementLine) for s in body):
        error = NothingToDo if _has_collective(func) else NotApplicable
        raise error(f"{func.name.value}: micro-batching needs a straight-line layer forward")
    stages: list[Stage] = []
    for stmt in body:
        comm = _has_collective(stmt) or (deep is not None and deep.statement_communicates(stmt))
        if stages and stages[-1].comm == comm:
            stages[-1].statements.append(stmt)
        else:
            stages.append(Stage(comm, [stmt]))
    if not any(s.comm for s in stages):
        raise NotApplicable(f"{func.name.value}: no collective to overlap")
    return stages


class DeepCollectives:
    """Collectives inside the layer's callees, seen through the file's summaries (analyze/summaries.py).

    A call whose summary holds a collective (`self.moe(x)` whose forward calls `dist.all_reduce`)
    makes its statement a comm stage, whole: the submodule's compute then runs on the comm stream
    too, but every collective of both micro-batches is still issued on one stream, in one order on
    every rank. Splitting the submodule's forward instead would need its collectives in straight
    line and an inliner; a collective under control flow there (an `if`, a loop) could be issued a
    different number of times per micro-batch, so it is refused. A compute statement calling
    something msrewrite cannot see into is refused too: a collective hidden there would be issued
    on the compute stream, out of order with the comm stream's.
    """

    def __init__(self, summaries, layer_cls: str, func: cst.FunctionDef) -> None:
        self.summaries, self.cls, self.func = summaries, layer_cls, func
        self.scope = summaries.scope_for(layer_cls, func.name.value)
        self.deep_calls: list[str] = []  # the calls that became comm stages, for messages
        self.unseen: set[str] = set()  # callees not seen into inside comm stages (they run there whole)

    def statement_communicates(self, stmt: cst.BaseStatement) -> bool:
        facts = node_facts(stmt, self.scope)
        if not facts.collective:
            if facts.unknown_callees or facts.unseen_work:
                raise NothingToDo(
                    f"{self.cls}.{self.func.name.value}: `{statement_source(stmt)}` calls "
                    f"{sorted(facts.unknown_callees | facts.unseen_work)[0]}: a collective in it would run on the compute stream, "
                    "out of order with the comm stream"
                )
            return False
        self.unseen |= facts.unknown_callees | facts.unseen_work
        for call in all_calls(stmt):
            if self.scope.effect_of(call).collective:
                where = self._nested_collective(self.summaries, self.cls, call, depth=0)
                if where:
                    raise NothingToDo(f"{self.cls}.{self.func.name.value}: {where}")
                self.deep_calls.append(_code(call.func).strip())
        return True

    def state_writes(self, stmt: cst.BaseStatement) -> tuple[list[str], str]:
        """(what the methods and submodules `stmt` calls write of their own state, ' in Class.method')."""
        return self._state_writes(self.summaries, self.cls, stmt, depth=0)

    def _state_writes(self, summaries, cls: str, node: cst.CSTNode, depth: int) -> tuple[list[str], str]:
        for call in all_calls(node):
            found = self._callee(summaries, cls, call) if depth <= 4 else None
            if found is None:
                continue
            owner, owner_cls, method = found
            written = shared_writes(method.body, _locals(method))
            if written:
                return written, f" in {owner_cls}.{method.name.value}"
            deeper = self._state_writes(owner, owner_cls, method.body, depth + 1)
            if deeper[0]:
                return deeper
        return [], ""

    def _callee(self, summaries, cls: str | None, call: cst.Call):
        """(summaries, class, def) a call runs: a method or a submodule's forward for `self.x(...)`,
        a function of this file or of a package msrewrite reads for `f(...)` / `m.f(...)` (class
        None)."""
        path = dotted_name(call.func) or ""
        if not path.startswith("self."):
            if torch_call_effect(call) is not None:
                return None  # dist.all_reduce and the rest of the table: known by name, not read
            found = summaries.find_function(path) if path else None
            return (found[0], None, found[0].functions[found[1]]) if found is not None else None
        if cls is None or path.count(".") != 1:
            return None
        name = path[len("self.") :]
        found = summaries.method_of(cls, name)
        if found is not None:
            return summaries, found[0], found[1]
        owner = summaries.attribute_class(cls, name)
        forward = owner[0].method_of(owner[1], "forward") if owner is not None else None
        return (owner[0], forward[0], forward[1]) if forward is not None else None

    def _nested_collective(self, summaries, cls: str, call: cst.Call, depth: int) -> str:
        """Why the collective behind `call` cannot be a stage boundary, or ''."""
        found = self._callee(summaries, cls, call)
        if found is None or depth > 4:
            return ""  # a collective the table knows by name (dist.*), or a module followed no further
        owner, owner_cls, method = found
        scope = owner.scope_for(owner_cls, method.name.value)
        label = f"{owner_cls}.{method.name.value}" if owner_cls is not None else f"{method.name.value}()"
        for stmt in method.body.body:
            facts = node_facts(stmt, scope)
            if not facts.collective:
                continue
            if not isinstance(stmt, cst.SimpleStatementLine):
                kind = _CONTROL_FLOW.get(type(stmt).__name__, f"a `{type(stmt).__name__.lower()}`")
                return (
                    f"the collective in {label} sits inside {kind}: the micro-batches could issue it a "
                    "different number of times, so the comm order cannot be kept"
                )
            for inner in all_calls(stmt):
                if scope.effect_of(inner).collective:
                    why = self._nested_collective(owner, owner_cls, inner, depth + 1)
                    if why:
                        return why
        return ""


_CONTROL_FLOW = {
    "If": "an `if`",
    "For": "a `for` loop",
    "While": "a `while` loop",
    "With": "a `with` block",
    "Try": "a `try`",
}


def shared_write(func: cst.FunctionDef, label: str, deep: DeepCollectives | None = None) -> None:
    """NothingToDo when a statement of the layer's forward writes state both micro-batches share:
    an attribute (`self.cache[i] = x`, `self.buf.copy_(x)`, `self.last = x`), also inside a method
    or submodule it calls (seen through `deep`'s summaries, e.g. a MoE block's expert counter), or a
    name it does not bind itself (a global). Run per micro-batch, it would be written twice, and one
    micro-batch's write would run beside the other's comm stage."""
    for stmt in _indented(func):  # stages_of refused a one-line body before
        written = shared_writes(stmt, _locals(func))
        where = ""
        if not written and deep is not None:
            written, where = deep.state_writes(stmt)
        if written:
            raise NothingToDo(
                f"{label}: `{statement_source(stmt)}` writes {written[0]}{where}, which both micro-batches share: "
                "each would write it, one beside the other's comm stage"
            )


def _locals(func: cst.FunctionDef) -> set[str]:
    params = func.params
    names = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
    names |= {star.name.value for star in (params.star_arg, params.star_kwarg) if isinstance(star, cst.Param)}
    return (names | node_facts(func.body).stores) - {"self"}


def shared_writes(node: cst.CSTNode, local: set[str]) -> list[str]:
    """What `node` writes that is not one of the function's own locals: `self.<...>` or a global."""
    shared = lambda path: path.split(".")[0] not in local or path.startswith("self.")  # noqa: E731
    written = {m for m in node_facts(node).mutates if shared(m)}
    written |= {shown for root, shown in _attribute_stores(node) if shared(root)}
    return sorted(written)


def _attribute_stores(stmt: cst.CSTNode) -> set[tuple[str, str]]:
    """(root path, text) of every attribute or subscript assigned: `self.cache[i] = x` -> ("self.cache", ...)."""
    found: set[tuple[str, str]] = set()

    def add(target: cst.BaseExpression) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                add(element.value)
        elif isinstance(target, cst.StarredElement):
            add(target.value)
        elif isinstance(target, (cst.Attribute, cst.Subscript)):
            root: cst.BaseExpression = target
            while isinstance(root, cst.Subscript):
                root = root.value
            found.add((dotted_name(root) or _code(root).strip(), _code(target).strip()))

    class _Targets(Visitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            add(node.target)

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            add(node.target)

        def visit_AugAssign(self, node: cst.AugAssign) -> None:
            add(node.target)

    stmt.visit(_Targets())
    return found


# The model: its layer loop -----------------------------------------------------------------------
@record
class LayerLoop:
    index: int  # body index of the `for` statement
    var: str  # the loop variable (`layer`)
    attr: str  # self.<attr> iterated (`layers`)
    carried: str  # the value threaded through the layers (`hidden_states`)


def find_layer_loop(func: cst.FunctionDef) -> LayerLoop | None:
    """`for layer in self.layers: hidden_states = layer(hidden_states)` at the top of `func`."""
    for index, stmt in enumerate(func.body.body):
        if not (isinstance(stmt, cst.For) and isinstance(stmt.target, cst.Name)):
            continue
        iterated = dotted_name(stmt.iter) or ""
        if not iterated.startswith("self.") or iterated.count(".") != 1 or len(stmt.body.body) != 1:
            continue
        line = stmt.body.body[0]
        if not (isinstance(line, cst.SimpleStatementLine) and isinstance(line.body[0], cst.Assign)):
            continue
        assign = line.body[0]
        value, target = assign.value, assign.targets[0].target
        if (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Name)
            and value.func.value == stmt.target.value
            and len(value.args) == 1
            and value.args[0].keyword is None
            and not value.args[0].star
            and isinstance(value.args[0].value, cst.Name)
            and isinstance(target, cst.Name)
            and target.value == value.args[0].value.value
            and len(assign.targets) == 1
        ):
            return LayerLoop(index, stmt.target.value, iterated[len("self.") :], target.value)
    return None


def layer_classes(model_cls: cst.ClassDef, attr: str, classes: dict[str, cst.ClassDef]) -> list[str]:
    """The file's classes whose instances fill self.<attr> (nn.ModuleList(Layer(...) for ...)):
    exactly one for an edit, since only that class gets a forward_microbatch."""
    init = kept_method(model_cls, "__init__")
    return _classes_assigned(init, attr, classes) if init is not None else []


def _classes_assigned(init: cst.FunctionDef, attr: str, classes: dict[str, cst.ClassDef]) -> list[str]:
    """The classes of `classes` called in the values `init` assigns to self.<attr>, sorted."""
    found: list[str] = []

    class _Assign(Visitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            target = node.targets[0].target
            if dotted_name(target) == f"self.{attr}":

                class _Calls(Visitor):
                    def visit_Call(self, call: cst.Call) -> None:
                        if isinstance(call.func, cst.Name) and call.func.value in classes:
                            found.append(call.func.value)

                node.value.visit(_Calls())

    init.visit(_Assign())
    return sorted(set(found))


def forward_of(cls: cst.ClassDef) -> cst.FunctionDef | None:
    return kept_method(cls, "forward")


def assigned_attributes(node: cst.CSTNode) -> set[str]:
    """Every `self.<name>` a class (or one of its methods) assigns (`self.name = ...`, `self.name: T = ...`)."""
    assigned: set[str] = set()

    class _Assigned(Visitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            self._add(node.target)

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            self._add(node.target)

        def _add(self, target: cst.BaseExpression) -> None:
            if (
                isinstance(target, cst.Attribute)
                and isinstance(target.value, cst.Name)
                and target.value.value == "self"
            ):
                assigned.add(target.attr.value)

    node.visit(_Assigned())
    return assigned


def existing_attribute(cls: cst.ClassDef, name: str, what: str) -> str:
    """`name` is an attribute the class assigns (`self.name = ...`): the edit will read it."""
    try:
        validate.attribute(name, what)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if name not in assigned_attributes(cls):
        raise BadInput(f"{what} {name}: {cls.name.value} never sets self.{name}")
    return name


@record
class Located:
    """The classes and functions a micro-batch edit touches, in a parsed module."""

    model: str
    model_cls: cst.ClassDef
    forward: cst.FunctionDef
    loop: LayerLoop
    layer: str
    layer_cls: cst.ClassDef
    layer_forward: cst.FunctionDef


def locate_model(module: cst.Module, target: str | None) -> Located:
    """The one model class whose forward runs a layer loop (the one `target` names), and its layer."""
    classes = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}
    candidates = []
    for name, cls in classes.items():
        forward = forward_of(cls)
        loop = find_layer_loop(forward) if forward is not None else None
        if loop is not None and (target is None or target in (name, f"{name}.forward")):
            candidates.append((name, cls, forward, loop))
    if not candidates:
        if target is not None and not any(target in (name, f"{name}.forward") for name in classes):
            raise BadInput(f"--target {target}: no such class with a forward in the file")
        raise NotApplicable("no `for layer in self.layers: hidden_states = layer(hidden_states)` loop to micro-batch")
    if len(candidates) > 1:
        names = ", ".join(f"{c[0]}.forward" for c in candidates)
        raise BadInput(f"ambiguous target: {len(candidates)} layer loops ({names}); pick one with --target")
    model_name, model_cls, forward, loop = candidates[0]
    if any(isinstance(s, cst.FunctionDef) and s.name.value == "forward_microbatch" for s in model_cls.body.body):
        raise NotApplicable(f"{model_name}.forward: already applied, nothing to do")
    layers = layer_classes(model_cls, loop.attr, classes)
    if len(layers) > 1:
        raise NothingToDo(
            f"{model_name}: self.{loop.attr} holds layers of several classes ({', '.join(layers)}); "
            "micro-batching gives one layer class a forward_microbatch"
        )
    layer_name = layers[0] if layers else None
    layer_forward = forward_of(classes[layer_name]) if layer_name else None
    if layer_name is None or layer_forward is None:
        raise NotApplicable(f"{model_name}: cannot tell which class fills self.{loop.attr}")
    return Located(model_name, model_cls, forward, loop, layer_name, classes[layer_name], layer_forward)  # type: ignore[arg-type]


def _span(stmt: cst.BaseStatement | cst.BaseSmallStatement, positions) -> SourceSpan:
    where = positions[stmt]
    return SourceSpan(where.start.line, where.end.line, statement_source(stmt))


def microbatch_plan(
    module: cst.Module,
    *,
    case: str,
    path: Path | str | None,
    mode: str,
    flag: FlagSpec,
    target: str | None = None,
    stream_tag: str = "microbatch_comm",
    second_group: str | None = None,
    assume_pure: tuple[str, ...] = (),
    text: str | None = None,
) -> MicrobatchPlan:
    """The micro-batch plan for the file's layer loop, or NothingToDo/BadInput with the reason."""
    from msrewrite.analyze.summaries import ModuleSummaries

    why = microbatch_flag_error(flag)
    if why:
        raise BadInput(why)
    try:
        validate.stream_tag(stream_tag, "--stream-tag")
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    found = locate_model(module, target)
    layer_label = f"{found.layer}.forward"
    params = found.layer_forward.params
    if (
        len(params.params) != 2
        or params.star_arg not in (None, cst.MaybeSentinel.DEFAULT)
        or params.kwonly_params
        or params.posonly_params
        or params.star_kwarg is not None
    ):
        raise NotApplicable(f"{layer_label}: micro-batching needs a layer forward(self, hidden_states)")
    if second_group is not None:
        second_group = existing_attribute(found.layer_cls, second_group, "--second-comm-group")
    deep = DeepCollectives(
        ModuleSummaries(module, assume_pure, path=Path(path) if path else None), found.layer, found.layer_forward
    )
    stages = stages_of(found.layer_forward, deep)
    if second_group and deep.deep_calls:
        raise NothingToDo(
            f"forward: --second-comm-group moves micro-batch 1's collectives to self.{second_group}, "
            f"but those inside {deep.deep_calls[0]}() take their group from the submodule"
        )
    last = found.layer_forward.body.body[-1]
    ret = last.body[0] if isinstance(last, cst.SimpleStatementLine) and len(last.body) == 1 else None
    if not isinstance(ret, cst.Return) or ret.value is None:
        raise NothingToDo(f"{layer_label}: micro-batching needs the layer to end with `return <tensor>`")
    shared_write(found.layer_forward, layer_label, deep)
    source = text if text is not None else module.code
    layer_positions = positions_for(module, layer_label, found.layer_forward, source)
    model_positions = positions_for(module, f"{found.model}.forward", found.forward, source)
    loop_stmt = found.forward.body.body[found.loop.index]
    deep_note = f"; comm stages through {', '.join(dict.fromkeys(deep.deep_calls))}()" if deep.deep_calls else ""
    group_note = f"; micro-batch 1 over self.{second_group}" if second_group else ""
    return MicrobatchPlan(
        case=case,
        file=str(path) if path is not None else "",
        function=f"{found.model}.forward",
        layer=layer_label,
        loop=_span(loop_stmt, model_positions),
        stages=tuple(
            MicrobatchStage(comm=s.comm, statements=tuple(_span(st, layer_positions) for st in s.statements))
            for s in stages
        ),
        stream_tag=stream_tag,
        flag=flag,
        mode=mode,
        second_group=second_group or "",
        summary=(
            f"{found.model} runs self.{found.loop.attr} as two micro-batches: {len(stages)} stages per "
            f"{found.layer}, {sum(s.comm for s in stages)} on the comm stream{deep_note}{group_note}"
        ),
        trust_boundary=tuple(sorted(deep.unseen)),
        assume_pure=tuple(assume_pure),
    )


def check_microbatch_plan(
    module: cst.Module, plan: MicrobatchPlan, text: str | None = None, path: Path | None = None
) -> MicrobatchPlan:
    """`plan` (from a plan file) as the analysis derives it from the file with the same options:
    BadInput when the file changed under it (stale), NothingToDo when the analysis would refuse it
    or splits the layer differently. What is carried out is always the derived plan."""
    stale_plan(module, plan, text)
    derived = microbatch_plan(
        module,
        case=plan.case,
        path=path if path is not None else plan.file,
        mode=plan.mode,
        flag=plan.flag,
        target=plan.function,
        stream_tag=plan.stream_tag,
        second_group=plan.second_group or None,
        assume_pure=plan.assume_pure,
        text=text,
    )
    if derived.layer != plan.layer or derived.loop != plan.loop:  # stale_plan saw the same file: a bug
        raise NothingToDo(
            f"refused plan for {plan.function}: the analysis finds {derived.layer} at line {derived.loop.first_line}"
        )
    if derived.stages != plan.stages:
        raise NothingToDo(
            f"refused plan for {plan.function}: the analysis splits {plan.layer} into "
            f"{describe_stages(derived.stages)}; the plan into {describe_stages(plan.stages)}"
        )
    return derived.with_changes(file=plan.file, summary=plan.summary or derived.summary)


def describe_stages(stages) -> str:
    """'L31-35 compute, L36 comm, L37 compute': a plan's stages, for messages."""

    def lines(stage) -> str:
        first, last = stage.statements[0].first_line, stage.statements[-1].last_line
        return f"L{first}" if first == last else f"L{first}-{last}"

    return ", ".join(f"{lines(s)} {'comm' if s.comm else 'compute'}" for s in stages)


def stale_plan(module: cst.Module, plan: MicrobatchPlan, text: str | None = None) -> Located:
    """The module's classes for `plan`; BadInput ("stale plan") when a statement the plan names is
    no longer at its line with its text."""
    model, _, _ = plan.function.partition(".")
    try:
        found = locate_model(module, model)
    except (BadInput, NothingToDo) as exc:
        if "already applied" in str(exc):
            raise
        raise BadInput(f"stale plan for {plan.function}: {exc}") from None
    if f"{found.layer}.forward" != plan.layer:
        raise BadInput(
            f"stale plan for {plan.function}: self.{found.loop.attr} holds {found.layer}, not "
            f"{plan.layer.rpartition('.')[0]}"
        )
    source = text if text is not None else module.code
    model_positions = positions_for(module, plan.function, found.forward, source)
    loop = _span(found.forward.body.body[found.loop.index], model_positions)
    if loop.source != plan.loop.source.strip() or loop.first_line != plan.loop.first_line:
        raise BadInput(
            f"stale plan for {plan.function}: line {plan.loop.first_line} is not its layer loop "
            f"{plan.loop.source.splitlines()[0]!r}"
        )
    positions = positions_for(module, plan.layer, found.layer_forward, source)
    by_line = {positions[s].start.line: s for s in found.layer_forward.body.body}
    for st in plan.statements:
        stmt = by_line.get(st.first_line)
        if stmt is None:
            raise BadInput(f"stale plan for {plan.layer}: no statement starts at line {st.first_line}")
        if statement_source(stmt) != st.source.strip():
            raise BadInput(f"stale plan for {plan.layer}: line {st.first_line} no longer reads {st.source.strip()!r}")
    if len(plan.statements) != len(by_line):
        missing = sorted(set(by_line) - {st.first_line for st in plan.statements})
        raise BadInput(
            f"stale plan for {plan.layer}: the plan leaves out the statement at line {missing[0]}"
            if missing
            else f"stale plan for {plan.layer}: the plan names statements twice"
        )
    return found
