"""Prefill micro-batching: two micro-batches through every layer, communication on its own stream.

The layer's forward is split into stages at its collectives (`dist.all_reduce`, `all_to_all`...):
compute, comm, compute, comm, compute. A generated `forward_microbatch(x_mb0, x_mb1)` runs each
stage once per micro-batch, micro-batch 1 one stage behind micro-batch 0, compute on the current
stream and every collective on one communication stream:

    main:  K0(0) K0(1) K1(0) K1(1) K2(0) K2(1)
    comm:     C1(0) C1(1) C2(0) C2(1)

so one micro-batch's dispatch or combine overlaps the other's compute. An event chain orders
each stage after the stage that produced its input, and because every collective is issued on
the same stream in the same order on every rank, collectives never run concurrently on a shared
communicator. The model's loop is forked into `forward_microbatch`, selected by the flag at the
top of `forward`; the original loop is untouched. Both streams wait for each other before the
micro-batches are concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from msrewrite.analyze.defuse import all_calls, dotted_name, is_docstring, node_facts
from msrewrite.analyze.walk import Visitor
from msrewrite.emit.engine import code_of, strip_leading
from msrewrite import validate
from msrewrite.errors import BadInput, NothingToDo
from msrewrite.validate import literal

COLLECTIVES = frozenset(
    {"all_reduce", "all_to_all", "all_to_all_single", "all_gather", "all_gather_into_tensor",
     "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce"}
)
COMM_HELPER_WORDS = ("dispatch", "combine", "all_to_all")


def is_collective(call: cst.Call) -> bool:
    module, _, name = (dotted_name(call.func) or "").rpartition(".")
    if module in ("dist", "torch.distributed") and name in COLLECTIVES:
        return True
    return any(word in name for word in COMM_HELPER_WORDS)  # named comm helpers


def _has_collective(node: cst.CSTNode) -> bool:
    found = False

    class _Finder(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            nonlocal found
            found = found or is_collective(call)

    node.visit(_Finder())
    return found


@dataclass
class Stage:
    comm: bool
    statements: list[cst.BaseStatement]


def stages_of(func: cst.FunctionDef, deep: "DeepCollectives | None" = None) -> list[Stage]:
    """The layer's statements grouped into alternating compute and comm stages. With `deep` (the
    file's summaries), a statement whose call holds a collective one module deeper (`self.moe(x)`)
    is a comm stage as a whole."""
    body = list(func.body.body)  # type: ignore[union-attr]
    if not body or not all(isinstance(s, cst.SimpleStatementLine) for s in body):
        raise NothingToDo(f"{func.name.value}: micro-batching needs a straight-line layer forward")
    stages: list[Stage] = []
    for stmt in body:
        comm = _has_collective(stmt) or (deep is not None and deep.statement_communicates(stmt))
        if stages and stages[-1].comm == comm:
            stages[-1].statements.append(stmt)
        else:
            stages.append(Stage(comm, [stmt]))
    if not any(s.comm for s in stages):
        raise NothingToDo(f"{func.name.value}: no collective to overlap")
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

    def statement_communicates(self, stmt: cst.BaseStatement) -> bool:
        facts = node_facts(stmt, self.scope)
        if not facts.collective:
            if facts.unknown_callees:
                raise NothingToDo(
                    f"{self.cls}.{self.func.name.value}: `{code_of(strip_leading(stmt)).strip()}` calls "
                    f"{sorted(facts.unknown_callees)[0]}: a collective in it would run on the compute stream, "
                    "out of order with the comm stream"
                )
            return False
        for call in all_calls(stmt):
            if self.scope.effect_of(call).collective:
                where = self._nested_collective(self.summaries, self.cls, call, depth=0)
                if where:
                    raise NothingToDo(f"{self.cls}.{self.func.name.value}: {where}")
                self.deep_calls.append(code_of(call.func).strip())
        return True

    def _callee(self, summaries, cls: str, call: cst.Call):
        """(summaries, class, def) a `self.x(...)` call runs: a method, or a submodule's forward."""
        path = dotted_name(call.func) or ""
        if not path.startswith("self.") or path.count(".") != 1:
            return None
        name = path[len("self."):]
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
        label = f"{owner_cls}.{method.name.value}"
        for stmt in method.body.body:  # type: ignore[union-attr]
            facts = node_facts(stmt, scope)
            if not facts.collective:
                continue
            if not isinstance(stmt, cst.SimpleStatementLine):
                kind = _CONTROL_FLOW.get(type(stmt).__name__, f"a `{type(stmt).__name__.lower()}`")
                return (f"the collective in {label} sits inside {kind}: the micro-batches could issue it a "
                        "different number of times, so the comm order cannot be kept")
            for inner in all_calls(stmt):
                if scope.effect_of(inner).collective:
                    why = self._nested_collective(owner, owner_cls, inner, depth + 1)
                    if why:
                        return why
        return ""


_CONTROL_FLOW = {"If": "an `if`", "For": "a `for` loop", "While": "a `while` loop", "With": "a `with` block",
                 "Try": "a `try`"}



class _Suffix(cst.CSTTransformer):
    """Rename the layer's own variables for one micro-batch (x -> x_mb0)."""

    def __init__(self, names: set[str], suffix: str) -> None:
        self.names, self.suffix = names, suffix

    def leave_Name(self, original, updated):
        return updated.with_changes(value=updated.value + self.suffix) if updated.value in self.names else updated

    def leave_Attribute(self, original, updated):
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original, updated):
        return updated.with_changes(keyword=original.keyword)


class _Group(cst.CSTTransformer):
    """Every collective of micro-batch 1 goes to the layer's second process group."""

    def __init__(self, attr: str) -> None:
        self.attr = attr

    def leave_Call(self, original, updated):
        if not is_collective(original):
            return updated
        group = cst.Attribute(value=cst.Name("self"), attr=cst.Name(self.attr))
        args = [a for a in updated.args if not (a.keyword is not None and a.keyword.value == "group")]
        if args:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        equal = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
        return updated.with_changes(args=[*args, cst.Arg(keyword=cst.Name("group"), value=group, equal=equal)])


def layer_microbatch_method(
    func: cst.FunctionDef, api: str, stream_tag: str, second_group: str | None = None,
    deep: DeepCollectives | None = None,
) -> cst.FunctionDef:
    """`forward_microbatch(self, x_mb0, x_mb1)` for a layer whose forward is `forward(self, x)`.

    With `second_group` (a process group the layer holds), micro-batch 1 communicates over that
    group on a second communication stream, so the two micro-batches' collectives may overlap."""
    params = [p.name.value for p in func.params.params]
    if len(params) != 2 or func.params.star_arg not in (None, cst.MaybeSentinel.DEFAULT) or func.params.kwonly_params:
        raise NothingToDo(f"{func.name.value}: micro-batching needs a layer forward(self, hidden_states)")
    x = params[1]
    stages = stages_of(func, deep)
    if second_group and deep is not None and deep.deep_calls:
        raise NothingToDo(
            f"{func.name.value}: --second-comm-group moves micro-batch 1's collectives to self.{second_group}, "
            f"but those inside {deep.deep_calls[0]}() take their group from the submodule"
        )
    body = list(func.body.body)  # type: ignore[union-attr]
    ret = body[-1].body[0] if isinstance(body[-1].body[0], cst.Return) else None  # type: ignore[union-attr]
    if ret is None or ret.value is None:
        raise NothingToDo(f"{func.name.value}: micro-batching needs the layer to end with `return <tensor>`")
    local = {x} | {n for s in body for n in node_facts(s).stores}

    lines = [
        f"def forward_microbatch(self, {x}_mb0, {x}_mb1):",
        '    """forward for two micro-batches: collectives on the comm stream, one micro-batch behind (msrewrite)."""',
        f"    current_stream = {api}.current_stream()",
        f"    comm_stream = _ms_side_stream({literal(stream_tag)})",
        "    comm_stream.wait_stream(current_stream)",
    ]
    if second_group:
        lines += [
            f"    # micro-batch 1 communicates over self.{second_group} on its own stream",
            f"    comm_stream_mb1 = _ms_side_stream({literal(stream_tag + '_mb1')})",
            "    comm_stream_mb1.wait_stream(current_stream)",
        ]
    order: list[tuple[int, int]] = [(0, 0)]
    for i in range(1, len(stages)):
        order += [(i, 0), (i - 1, 1)]
    order.append((len(stages) - 1, 1))
    produced_on: dict[tuple[int, int], str] = {}  # (stage, mb) -> event name recorded after it
    body_nodes: list[cst.BaseStatement] = [*cst.parse_module("\n".join(lines) + "\n    pass\n").body[0].body.body[:-1]]
    for stage_index, mb in order:
        stage = stages[stage_index]
        suffix = f"_mb{mb}"
        renamed = [strip_leading(s).visit(_Suffix(local, suffix)) for s in stage.statements]
        comm = "comm_stream_mb1" if second_group and mb == 1 else "comm_stream"
        if second_group and mb == 1 and stage.comm:
            renamed = [s.visit(_Group(second_group)) for s in renamed]
        if stage_index == len(stages) - 1 and isinstance(renamed[-1].body[0], cst.Return):  # type: ignore[union-attr]
            ret_value = renamed[-1].body[0].value  # type: ignore[union-attr]
            renamed[-1] = cst.SimpleStatementLine(
                body=[cst.Assign(targets=[cst.AssignTarget(cst.Name(f"out{suffix}"))], value=ret_value)]
            )
        previous = produced_on.get((stage_index - 1, mb))
        event = f"stage{stage_index}{suffix}_done"
        last = stage_index == len(stages) - 1  # nothing waits for the last stage: no event
        what = "communication" if stage.comm else "compute"
        head = [f"# stage {stage_index} ({what}), micro-batch {mb}"]
        if stage.comm:
            wait = [f"{comm}.wait_event({previous})"] if previous else []
            record = [] if last else [f"    {event} = {comm}.record_event()"]
            text = head + [f"with {api}.stream({comm}):", *("    " + w for w in wait), "    __ms_stage__", *record]
        else:
            wait = [f"current_stream.wait_event({previous})"] if previous else []
            record = [] if last else [f"{event} = current_stream.record_event()"]
            text = head + [*wait, "__ms_stage__", *record]
        block = cst.parse_module("pass\n" + "\n".join(text) + "\n").body[1:]
        body_nodes += _splice_stage(block, renamed)
        produced_on[(stage_index, mb)] = event
    streams = ["comm_stream", *(["comm_stream_mb1"] if second_group else [])]
    tail = [
        "# the streams meet before the micro-batches leave the layer",
        *(f"current_stream.wait_stream({name})" for name in streams),
        *(f"{name}.wait_stream(current_stream)" for name in streams),
        "return out_mb0, out_mb1",
    ]
    body_nodes += list(cst.parse_module("pass\n" + "\n".join(tail) + "\n").body[1:])
    template = cst.parse_module("\n".join(lines[:1]) + "\n    pass\n").body[0]
    return template.with_changes(  # type: ignore[union-attr]
        body=template.body.with_changes(body=body_nodes),  # type: ignore[union-attr]
        leading_lines=[cst.EmptyLine(indent=False)],
    )


def _splice_stage(block: list[cst.BaseStatement], stage: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    class _Splice(cst.CSTTransformer):
        def leave_SimpleStatementLine(self, original, updated):
            if code_of(strip_leading(updated)).strip() == "__ms_stage__":
                first = stage[0].with_changes(leading_lines=updated.leading_lines)  # keep the stage comment
                return cst.FlattenSentinel([first, *stage[1:]])
            return updated

    return list(cst.Module(body=block).visit(_Splice()).body)


# The model: fork its layer loop --------------------------------------------------------------------
@dataclass
class LayerLoop:
    index: int  # body index of the `for` statement
    var: str  # the loop variable (`layer`)
    attr: str  # self.<attr> iterated (`layers`)
    carried: str  # the value threaded through the layers (`hidden_states`)


def find_layer_loop(func: cst.FunctionDef) -> LayerLoop | None:
    """`for layer in self.layers: hidden_states = layer(hidden_states)` at the top of `func`."""
    for index, stmt in enumerate(func.body.body):  # type: ignore[union-attr]
        if not (isinstance(stmt, cst.For) and isinstance(stmt.target, cst.Name)):
            continue
        iterated = dotted_name(stmt.iter) or ""
        if not iterated.startswith("self.") or len(stmt.body.body) != 1:  # type: ignore[union-attr]
            continue
        line = stmt.body.body[0]  # type: ignore[union-attr]
        if not (isinstance(line, cst.SimpleStatementLine) and isinstance(line.body[0], cst.Assign)):
            continue
        assign = line.body[0]
        value, target = assign.value, assign.targets[0].target
        if (
            isinstance(value, cst.Call)
            and isinstance(value.func, cst.Name)
            and value.func.value == stmt.target.value
            and len(value.args) == 1
            and isinstance(value.args[0].value, cst.Name)
            and isinstance(target, cst.Name)
            and target.value == value.args[0].value.value
        ):
            return LayerLoop(index, stmt.target.value, iterated[len("self.") :], target.value)
    return None


def model_microbatch_method(func: cst.FunctionDef, loop: LayerLoop, dim: int) -> cst.FunctionDef:
    """A copy of the model's forward whose layer loop runs both micro-batches."""
    h, var, attr = loop.carried, loop.var, loop.attr
    text = [
        "# msrewrite(prefill-microbatch): two micro-batches through every layer, then back together.",
        f"{h}_mb0, {h}_mb1 = {h}.chunk(2, dim={dim})",
        f"for {var} in self.{attr}:",
        f"    {h}_mb0, {h}_mb1 = {var}.forward_microbatch({h}_mb0, {h}_mb1)",
        f"{h} = torch.cat([{h}_mb0, {h}_mb1], dim={dim})",
    ]
    body = list(func.body.body)  # type: ignore[union-attr]
    replacement = list(cst.parse_module("pass\n" + "\n".join(text) + "\n").body[1:])
    replacement[0] = replacement[0].with_changes(
        leading_lines=[*body[loop.index].leading_lines, *replacement[0].leading_lines]
    )
    body[loop.index : loop.index + 1] = replacement
    if body and is_docstring(body[0]):
        body = body[1:]
    doc = cst.parse_statement(f'"""{func.name.value} with its layers run as two micro-batches (msrewrite)."""\n')
    return func.with_changes(
        name=cst.Name("forward_microbatch"),
        body=func.body.with_changes(body=[doc, *body]),
        leading_lines=[cst.EmptyLine(indent=False)],
        decorators=(),
    )



# The whole edit -----------------------------------------------------------------------------------
def _layer_class(model_cls: cst.ClassDef, attr: str, classes: dict[str, cst.ClassDef]) -> str | None:
    """The class whose instances fill self.<attr> (nn.ModuleList(Layer(...) for ...))."""
    for stmt in model_cls.body.body:  # type: ignore[union-attr]
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
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

            stmt.visit(_Assign())
            return found[0] if found else None
    return None


def _forward_of(cls: cst.ClassDef) -> cst.FunctionDef | None:
    return next(
        (s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "forward"),  # type: ignore[union-attr]
        None,
    )


def _call_args(func: cst.FunctionDef) -> str:
    p = func.params
    parts = [q.name.value for q in p.params[1:]]
    if isinstance(p.star_arg, cst.Param):
        parts.append("*" + p.star_arg.name.value)
    parts += [f"{q.name.value}={q.name.value}" for q in p.kwonly_params]
    if p.star_kwarg is not None:
        parts.append("**" + p.star_kwarg.name.value)
    return ", ".join(parts)


def _existing_attribute(cls: cst.ClassDef, name: str, what: str) -> str:
    """`name` is an attribute the class assigns (`self.name = ...`): the edit will read it."""
    try:
        validate.attribute(name, what)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    assigned: set[str] = set()

    class _Assigned(Visitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            self._add(node.target)

        def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
            self._add(node.target)

        def _add(self, target: cst.BaseExpression) -> None:
            if isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name) and target.value.value == "self":
                assigned.add(target.attr.value)

    cls.visit(_Assigned())
    if name not in assigned:
        raise BadInput(f"{what} {name}: {cls.name.value} never sets self.{name}")
    return name


def microbatch_edit(
    module: cst.Module, mode: str, flag, target: str | None, stream_tag: str, dim: int = 0,
    second_group: str | None = None, path=None, assume_pure: tuple[str, ...] = (),
):
    """(new module, model function name): the forked micro-batch path for the first layer loop."""
    from msrewrite.emit.engine import Emission, add_helpers, flag_attribute

    classes = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}
    candidates = []
    for name, cls in classes.items():
        forward = _forward_of(cls)
        loop = find_layer_loop(forward) if forward is not None else None
        if loop is not None and (target is None or target in (name, f"{name}.forward")):
            candidates.append((name, cls, forward, loop))
    if not candidates:
        raise NothingToDo("no `for layer in self.layers: hidden_states = layer(hidden_states)` loop to micro-batch")
    if len(candidates) > 1:
        from msrewrite.errors import BadInput

        names = ", ".join(f"{c[0]}.forward" for c in candidates)
        raise BadInput(f"ambiguous target: {len(candidates)} layer loops ({names}); pick one with --target")
    model_name, model_cls, forward, loop = candidates[0]
    if any(isinstance(s, cst.FunctionDef) and s.name.value == "forward_microbatch" for s in model_cls.body.body):  # type: ignore[union-attr]
        raise NothingToDo(f"{model_name}.forward: already applied, nothing to do")
    layer_name = _layer_class(model_cls, loop.attr, classes)
    layer_forward = _forward_of(classes[layer_name]) if layer_name else None
    if layer_forward is None:
        raise NothingToDo(f"{model_name}: cannot tell which class fills self.{loop.attr}")
    stream_tag = validate.stream_tag(stream_tag)
    if flag.kind in ("sglang", "vllm-ascend") or flag.gate is not None:
        from msrewrite.errors import BadInput

        raise BadInput("prefill-microbatch supports --flag env:NAME only, and no --gate")
    if second_group is not None:
        second_group = _existing_attribute(classes[layer_name], second_group, "--second-comm-group")
    api = "torch.cuda" if mode == "cuda" else "torch.npu"
    from msrewrite.analyze.summaries import ModuleSummaries

    deep = DeepCollectives(ModuleSummaries(module, assume_pure, path=path), layer_name, layer_forward)
    layer_method = layer_microbatch_method(layer_forward, api, stream_tag, second_group, deep)

    switch = flag_attribute(flag.name)
    default = "True" if flag.default else "False"
    init_lines = [
        f"# msrewrite(prefill-microbatch): {flag.name}=0 keeps the single-batch layer loop.",
        f"self.{switch} = _ms_env_flag({literal(flag.name)}, {default})",
    ]
    dispatch = [
        "# msrewrite(prefill-microbatch): two micro-batches on two streams when enabled (forward_microbatch);",
        "# the loop below is the original path.",
        f"if _ms_microbatch(self.{switch}, {loop.carried}):",
        f"    return self.forward_microbatch({_call_args(forward)})",
    ]
    model_method = model_microbatch_method(forward, loop, dim)
    dispatch_nodes = list(cst.parse_module("pass\n" + "\n".join(dispatch) + "\n").body[1:])
    init_nodes = list(cst.parse_module("pass\n" + "\n".join(init_lines) + "\n").body[1:])

    class _Edit(cst.CSTTransformer):
        def leave_ClassDef(self, original, updated):
            name = original.name.value
            if name not in (model_name, layer_name):
                return updated
            body: list[cst.BaseStatement] = []
            for stmt in updated.body.body:
                if name == model_name and isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                    inner = list(stmt.body.body)
                    at = 1 if inner and is_docstring(inner[0]) else 0
                    inner[at:at] = dispatch_nodes
                    body += [stmt.with_changes(body=stmt.body.with_changes(body=inner)), model_method]
                    continue
                if name == model_name and isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                    stmt = stmt.with_changes(body=stmt.body.with_changes(body=[*stmt.body.body, *init_nodes]))
                body.append(stmt)
                if name == layer_name and isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                    body.append(layer_method)
            return updated.with_changes(body=updated.body.with_changes(body=body))

    new = module.visit(_Edit())
    kind = "cuda" if mode == "cuda" else "npu"
    em = Emission(
        helpers=["_ms_env_flag", f"_ms_side_stream:{kind}", f"_ms_microbatch:{kind}"],
        imports=["torch_npu"] if kind == "npu" else [],
        needs_os=True,
    )
    return add_helpers(new, [em], mode), f"{model_name}.forward"
