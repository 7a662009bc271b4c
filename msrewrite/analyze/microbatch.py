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

import dataclasses
from pathlib import Path

import libcst as cst

from msrewrite import validate
from msrewrite.analyze.definitions import kept_method
from msrewrite.analyze.defuse import all_calls, dotted_name, node_facts
from msrewrite.analyze.positions import positions_for
from msrewrite.analyze.torch_effects import torch_call_effect
from msrewrite.analyze.walk import Visitor
from msrewrite.analyze.wrappers import is_transparent, opaque_context
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


def shown_statement(stmt: cst.BaseStatement | cst.BaseSmallStatement, limit: int = 120) -> str:
    """A statement for a one-line message: its text on one line, cut at `limit` characters."""
    text = " ".join(statement_source(stmt).split()).replace("( ", "(").replace(" )", ")")
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        label = f"{deep.cls}.{func.name.value}" if deep is not None else func.name.value
        compound = next((s for s in body if not isinstance(s, cst.SimpleStatementLine)), None)
        kind = _CONTROL_FLOW.get(type(compound).__name__, "") if compound is not None else ""
        where = f" (it holds {kind})" if kind else ""
        raise error(f"{label}: micro-batching needs a straight-line layer forward{where}")
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
                    f"{self.cls}.{self.func.name.value}: `{shown_statement(stmt)}` calls "
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


def shared_write(
    func: cst.FunctionDef, label: str, deep: DeepCollectives | None = None, shared: tuple[str, ...] = ()
) -> None:
    """NothingToDo when a statement of the layer's forward writes state both micro-batches share:
    an attribute (`self.cache[i] = x`, `self.buf.copy_(x)`, `self.last = x`), also inside a method
    or submodule it calls (seen through `deep`'s summaries, e.g. a MoE block's expert counter), or a
    name it does not bind itself (a global). Run per micro-batch, it would be written twice, and one
    micro-batch's write would run beside the other's comm stage."""
    local = _locals(func) - set(shared)  # a parameter both micro-batches get whole is theirs to share
    for stmt in _indented(func):  # stages_of refused a one-line body before
        written = shared_writes(stmt, local)
        where = ""
        if not written and deep is not None:
            written, where = deep.state_writes(stmt)
        if written:
            raise NothingToDo(
                f"{label}: `{shown_statement(stmt)}` writes {written[0]}{where}, which both micro-batches share: "
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
    index: int  # body index of the top-level statement holding the loop (the `for`, or a `with` around it)
    var: str  # the loop variable (`layer`)
    attr: str  # self.<attr> iterated (`layers`)
    carried: str  # the hidden states: the call's first argument, threaded through the layers
    node: cst.For | None = None  # the `for` statement
    call: cst.Call | None = None  # the layer call in its body
    targets: tuple[str, ...] = ()  # the names the call assigns, in order (`residual, hidden_states`)
    tuple_target: bool = False  # `a, b = layer(...)` rather than `a = layer(...)`
    withs: tuple[cst.With, ...] = ()  # the `with` blocks around the loop, outermost first

    @property
    def simple(self) -> bool:
        """`for layer in self.layers: hidden_states = layer(hidden_states)` at the top of the
        function: the shape forked into a copy of the model's forward."""
        assert self.call is not None
        return not self.tuple_target and not self.withs and len(self.call.args) == 1


def find_layer_loop(func: cst.FunctionDef) -> LayerLoop | None:
    """`for layer in self.layers: <targets> = layer(<hidden_states>, ...)` in `func`, at its top or
    inside `with` blocks (cann-recipes' `with superkernel_scope(...)`): the call's first argument is
    one of the names it assigns (the hidden states); the other names it assigns are state threaded
    through the layers (`residual, hidden_states = layer(hidden_states, past_residual=residual)`)."""
    for index, stmt in enumerate(_indented(func)):
        found = _loop_in(stmt, ())
        if found is not None:
            return dataclasses.replace(found, index=index)
    return None


def _loop_in(stmt: cst.BaseStatement, withs: tuple[cst.With, ...]) -> LayerLoop | None:
    if isinstance(stmt, cst.With) and stmt.asynchronous is None and isinstance(stmt.body, cst.IndentedBlock):
        for inner in stmt.body.body:
            found = _loop_in(inner, (*withs, stmt))
            if found is not None:
                return found
        return None
    if not (isinstance(stmt, cst.For) and isinstance(stmt.target, cst.Name)) or stmt.asynchronous is not None:
        return None
    iterated = dotted_name(stmt.iter) or ""
    if not iterated.startswith("self.") or iterated.count(".") != 1 or len(stmt.body.body) != 1:
        return None
    if stmt.orelse is not None:
        return None
    line = stmt.body.body[0]
    if not (isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 and isinstance(line.body[0], cst.Assign)):
        return None
    assign = line.body[0]
    value, target = assign.value, assign.targets[0].target
    if len(assign.targets) != 1 or not isinstance(value, cst.Call):
        return None
    if not (isinstance(value.func, cst.Name) and value.func.value == stmt.target.value):
        return None
    if isinstance(target, cst.Name):
        names: tuple[str, ...] = (target.value,)
    elif isinstance(target, (cst.Tuple, cst.List)) and all(isinstance(e, cst.Element) for e in target.elements):
        if not all(isinstance(e.value, cst.Name) for e in target.elements):
            return None
        names = tuple(e.value.value for e in target.elements)  # type: ignore[attr-defined]
    else:
        return None
    first = value.args[0] if value.args else None
    if (
        first is None
        or first.keyword is not None
        or first.star
        or not isinstance(first.value, cst.Name)
        or first.value.value not in names
        or len(set(names)) != len(names)
    ):
        return None
    return LayerLoop(
        0,
        stmt.target.value,
        iterated[len("self.") :],
        first.value.value,
        node=stmt,
        call=value,
        targets=names,
        tuple_target=not isinstance(target, cst.Name),
        withs=withs,
    )


@record
class LayerArgs:
    """What the layer loop hands each layer, by the layer's parameter: `split` ones get one half per
    micro-batch (the hidden states first, then threaded state and --split-arg values), `shared`
    ones the same value for both (a constant, a scalar parameter, a --shared-arg value)."""

    split: tuple[tuple[str, str], ...]  # (layer parameter, the value's source at the call)
    shared: tuple[tuple[str, str], ...]  # (layer parameter or **kwargs key, the value's source)
    kwargs_keys: tuple[str, ...] = ()  # shared keys that land in the layer's **kwargs

    def split_source(self, param: str) -> str:
        return dict(self.split)[param]


_SCALAR_ANNOTATIONS = frozenset({"bool", "int", "float", "str"})


def _scalar_parameter(name: str, forward: cst.FunctionDef) -> bool:
    """`name` is a parameter of the model's forward annotated as a scalar (`is_prefill: bool`,
    `Optional[int]`): the same value for every sequence."""
    params = forward.params
    for param in (*params.posonly_params, *params.params, *params.kwonly_params):
        if param.name.value != name or param.annotation is None:
            continue
        text = _code(param.annotation.annotation).replace(" ", "")
        for wrapper in ("Optional[", "typing.Optional["):
            if text.startswith(wrapper) and text.endswith("]"):
                text = text[len(wrapper) : -1]
        return text in _SCALAR_ANNOTATIONS or all(part in _SCALAR_ANNOTATIONS | {"None"} for part in text.split("|"))
    return False


def _constant(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString)):
        return True
    return isinstance(expr, cst.Name) and expr.value in ("None", "True", "False")


def layer_arguments(
    loop: LayerLoop,
    layer_forward: cst.FunctionDef,
    model_forward: cst.FunctionDef,
    label: str,
    split_args: tuple[str, ...] = (),
    shared_args: tuple[str, ...] = (),
) -> LayerArgs:
    """Each argument of the layer call matched to the layer's parameter and sorted into split or
    shared (LayerArgs). The hidden states and every other threaded name are split; any other value
    is split or shared only as `split_args` / `shared_args` say (by the layer's parameter or the
    variable passed), unless it is a constant or a scalar parameter: msrewrite cannot tell from the
    source whether a tensor holds one row per sequence. NothingToDo names every value it would have
    to guess about, at once; BadInput for a declared name the loop does not pass."""
    sorter = _ArgSorter(loop, model_forward, label, split_args, shared_args)
    for param, arg, to_kwargs in _matched_parameters(loop, layer_forward, label):
        sorter.add(param, arg, to_kwargs)
    return sorter.result()


def _matched_parameters(loop: LayerLoop, layer_forward: cst.FunctionDef, label: str) -> list[tuple[str, cst.Arg, bool]]:
    """(the layer's parameter, the argument, whether it lands in **kwargs) for each argument of the call."""
    assert loop.call is not None
    params = layer_forward.params
    if params.posonly_params or isinstance(params.star_arg, cst.Param):
        raise NotApplicable(
            f"{label}: micro-batching needs a layer forward whose parameters have names (no / or *args)"
        )
    positional = [p.name.value for p in params.params[1:]]
    named = set(positional) | {p.name.value for p in params.kwonly_params}
    matched = []
    for k, arg in enumerate(loop.call.args):
        if arg.star:
            raise NotApplicable(
                f"{label}: the layer call unpacks `{arg.star}`: micro-batching needs every argument by name"
            )
        if arg.keyword is None:
            if k >= len(positional):
                raise NotApplicable(f"{label}: the layer call passes more positional arguments than the layer takes")
            matched.append((positional[k], arg, False))
            continue
        param = arg.keyword.value
        if param not in named and params.star_kwarg is None:
            raise NotApplicable(f"{label}: the layer call passes {param}=, which the layer does not take")
        matched.append((param, arg, param not in named))
    return matched


class _ArgSorter:
    """layer_arguments' bookkeeping: the split and shared values so far, what was declared and
    used, and what would have to be guessed."""

    def __init__(self, loop: LayerLoop, model_forward: cst.FunctionDef, label: str, split_args, shared_args) -> None:
        self.loop, self.model_forward, self.label = loop, model_forward, label
        self.split_args, self.shared_args = set(split_args), set(shared_args)
        self.split: list[tuple[str, str]] = []
        self.shared: list[tuple[str, str]] = []
        self.kwargs_keys: list[str] = []
        self.undeclared: list[str] = []  # values passed to every layer
        self.undeclared_state: list[str] = []  # state threaded through the layers
        self.used: set[str] = set()
        self.threaded: set[str] = set()

    def add(self, param: str, arg: cst.Arg, to_kwargs: bool) -> None:
        value, loop, label = arg.value, self.loop, self.label
        source = _code(value).strip()
        variable = value.value if isinstance(value, cst.Name) else None
        names = {param, *([variable] if variable else [])}
        if to_kwargs:
            self.kwargs_keys.append(param)
        if variable is not None and variable in loop.targets:
            self._threaded(param, variable, source, names, to_kwargs)
        elif node_facts(value).loads & (set(loop.targets) | {loop.var}):
            raise NothingToDo(
                f"{label}: the layer call computes `{param}={source}` from the layer or the state it threads; "
                "micro-batching splits only values passed by name"
            )
        elif names & self.split_args:
            if dotted_name(value) is None:  # halved as `None if v is None else v.chunk(...)`: read twice
                raise NothingToDo(
                    f"{label}: --split-arg {param}: the layer call computes it (`{source}`); pass it by name"
                )
            self.used |= names & self.split_args
            self.split.append((param, source))
        elif names & self.shared_args:
            self.used |= names & self.shared_args
            self.shared.append((param, source))
        elif _constant(value) or (variable is not None and _scalar_parameter(variable, self.model_forward)):
            self.shared.append((param, source))
        else:
            self.undeclared.append(_shown_arg(param, source))

    def _threaded(self, param: str, variable: str, source: str, names: set[str], to_kwargs: bool) -> None:
        if to_kwargs:
            raise NotApplicable(f"{self.label}: the layer call passes {variable} through **kwargs")
        if variable in self.threaded:
            raise NotApplicable(f"{self.label}: the layer call passes {variable} twice")
        self.threaded.add(variable)
        if names & self.shared_args:
            raise BadInput(
                f"--shared-arg {sorted(names & self.shared_args)[0]}: {variable} comes back from every layer "
                "into the next, so each micro-batch threads its own (--split-arg)"
            )
        if variable != self.loop.carried and not names & self.split_args:
            self.undeclared_state.append(variable)
            return
        self.used |= names & self.split_args
        self.split.append((param, source))

    def result(self) -> LayerArgs:
        loop = self.loop
        missing = [name for name in loop.targets if name not in self.threaded]
        if missing:
            raise NotApplicable(
                f"{self.label}: the layer loop assigns {missing[0]} but does not pass it back to the next layer"
            )
        for option, given in (("--split-arg", self.split_args), ("--shared-arg", self.shared_args)):
            unknown = sorted(given - self.used)
            if unknown:
                raise BadInput(
                    f"{option} {unknown[0]}: the layer loop passes no such argument (or it is the hidden states)"
                )
        if self.undeclared or self.undeclared_state:
            what = []
            if self.undeclared_state:
                what.append(f"threads {', '.join(self.undeclared_state)} through the layers beside {loop.carried}")
            if self.undeclared:
                what.append(f"passes {', '.join(self.undeclared)} to every layer")
            raise NothingToDo(
                f"{self.label}: the layer loop {' and '.join(what)}; msrewrite cannot tell from the source whether "
                "each holds one row per sequence (each micro-batch then needs its half: --split-arg NAME) or is the "
                "same for every sequence (both get it whole: --shared-arg NAME; threaded state cannot be)"
            )
        return LayerArgs(tuple(self.split), tuple(self.shared), tuple(self.kwargs_keys))


def _shown_arg(param: str, source: str) -> str:
    return f"`{source}`" if param == source else f"`{param}={source}`"


def layer_classes(model_cls: cst.ClassDef, attr: str, classes: dict[str, cst.ClassDef]) -> list[str]:
    """The file's classes whose instances fill self.<attr> (nn.ModuleList(Layer(...) for ...)):
    exactly one for an edit, since only that class gets a forward_microbatch."""
    init = kept_method(model_cls, "__init__")
    found = _classes_assigned(init, attr, classes) if init is not None else []
    # cann-recipes build the layers in a method __init__ calls (`self.init_modules(config)`)
    return found or _classes_assigned(model_cls, attr, classes)


def _classes_assigned(init: cst.CSTNode, attr: str, classes: dict[str, cst.ClassDef]) -> list[str]:
    """The classes of `classes` called in the values `init` (a method, or a whole class) assigns to
    self.<attr>, sorted."""
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


def _check_simple_layer(found, layer_label: str) -> None:
    """The first loop shape (`h = layer(h)`) forks a copy of the forward: the layer takes the
    hidden states alone."""
    if not found.loop.simple:
        return
    params = found.layer_forward.params
    if (
        len(params.params) != 2
        or params.star_arg not in (None, cst.MaybeSentinel.DEFAULT)
        or params.kwonly_params
        or params.posonly_params
        or params.star_kwarg is not None
    ):
        raise NotApplicable(f"{layer_label}: micro-batching needs a layer forward(self, hidden_states)")


def _check_layer_returns(layer_forward: cst.FunctionDef, layer_label: str) -> None:
    last = layer_forward.body.body[-1]
    ret = last.body[0] if isinstance(last, cst.SimpleStatementLine) and len(last.body) == 1 else None
    if not isinstance(ret, cst.Return) or ret.value is None:
        raise NothingToDo(f"{layer_label}: micro-batching needs the layer to end with `return <tensor>`")


def _plan_notes(found, args, deep, second_group: str | None) -> str:
    """The summary's notes: comm stages one module deeper, the second group, threaded, split and
    shared values."""
    threaded = [name for name in found.loop.targets if name != found.loop.carried]
    split_note = [source_ for _param, source_ in args.split[1:] if source_ not in threaded]
    notes = f"; comm stages through {', '.join(dict.fromkeys(deep.deep_calls))}()" if deep.deep_calls else ""
    notes += f"; micro-batch 1 over self.{second_group}" if second_group else ""
    notes += f"; each micro-batch threads its own {', '.join(threaded)}" if threaded else ""
    notes += f"; split with the batch: {', '.join(split_note)}" if split_note else ""
    notes += f"; shared by both: {', '.join(p for p, _ in args.shared)}" if args.shared else ""
    return notes


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
    split_args: tuple[str, ...] = (),
    shared_args: tuple[str, ...] = (),
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
    _check_simple_layer(found, layer_label)
    if second_group is not None:
        second_group = existing_attribute(found.layer_cls, second_group, "--second-comm-group")
    deep = DeepCollectives(
        ModuleSummaries(module, assume_pure, path=Path(path) if path else None), found.layer, found.layer_forward
    )
    stages = stages_of(found.layer_forward, deep)
    args = layer_arguments(
        found.loop, found.layer_forward, found.forward, f"{found.model}.forward", split_args, shared_args
    )
    if second_group and deep.deep_calls:
        raise NothingToDo(
            f"forward: --second-comm-group moves micro-batch 1's collectives to self.{second_group}, "
            f"but those inside {deep.deep_calls[0]}() take their group from the submodule"
        )
    _check_layer_returns(found.layer_forward, layer_label)
    shared_write(found.layer_forward, layer_label, deep, shared=tuple(p for p, _ in args.shared))
    source = text if text is not None else module.code
    layer_positions = positions_for(module, layer_label, found.layer_forward, source)
    model_positions = positions_for(module, f"{found.model}.forward", found.forward, source)
    loop_stmt = found.loop.node
    assert loop_stmt is not None
    # A `with` around the loop stays around both paths: the micro-batch loop is entered and left
    # where the original is, and the streams meet at the end of every layer, so nothing of it is
    # pending on the comm stream when the block exits. What the context manager does is still not
    # seen: named with the callees not seen into.
    contexts = [
        f"{_context_name(w)} (the `with` around the layer loop)" for w in found.loop.withs if not is_transparent(w)
    ]
    notes = _plan_notes(found, args, deep, second_group)
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
            f"{found.layer}, {sum(s.comm for s in stages)} on the comm stream{notes}"
        ),
        trust_boundary=tuple(validate.clipped(note) for note in (*sorted(deep.unseen), *contexts)),
        assume_pure=tuple(assume_pure),
        split_args=tuple(split_args),
        shared_args=tuple(shared_args),
    )


def _context_name(node: cst.With) -> str:
    """`superkernel_scope` for `with superkernel_scope(...):`, else the item as written."""
    text = opaque_context(node)
    item = next(i.item for i in node.items if " ".join(_code(i.item).split()) == text)
    return (dotted_name(item.func) or text) if isinstance(item, cst.Call) else text


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
        split_args=plan.split_args,
        shared_args=plan.shared_args,
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
    assert found.loop.node is not None
    loop = _span(found.loop.node, model_positions)
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
