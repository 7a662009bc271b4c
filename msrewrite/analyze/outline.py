"""What a module holds, read without editing it: its functions and classes, what a class's
`__init__` assigns, the names bound at top level, and fresh names that bind nothing yet.

The emitter (msrewrite/emit/) decides where its lines go from these reads; the cases use
`iter_functions` and `already_applied` to find their functions.
"""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from msrewrite.analyze.definitions import kept_method, shadowed_defs
from msrewrite.analyze.defuse import dotted_name, node_facts
from msrewrite.analyze.walk import Visitor
from msrewrite.plan import HELPER_PREFIX, OverlapPlan

_EMPTY = cst.Module(body=[])


def unique_name(base: str, taken: set[str]) -> str:
    """`base`, else `base_2`, `base_3`, ...: the first not in `taken`, which it joins."""
    name, n = base, 2
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def iter_functions(module: cst.Module) -> Iterator[tuple[str, cst.FunctionDef, cst.ClassDef | None]]:
    """(qualified name, FunctionDef, enclosing ClassDef or None) for every def Python keeps,
    classes nested: a def that a later one of the same name replaces is dead code, never a target
    (analyze/definitions.py)."""

    def walk(body, prefix: str, cls: cst.ClassDef | None, dead: set[int]):
        for stmt in body:
            if isinstance(stmt, cst.FunctionDef):
                if id(stmt) not in dead:
                    yield prefix + stmt.name.value, stmt, cls
            elif isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
                inner = stmt.body.body
                yield from walk(inner, f"{prefix}{stmt.name.value}.", stmt, shadowed_defs(inner))
            elif isinstance(stmt, (cst.If, cst.Try)) and isinstance(stmt.body, cst.IndentedBlock):
                yield from walk(stmt.body.body, prefix, cls, dead)

    yield from walk(module.body, "", None, shadowed_defs(module.body))


def already_applied(func: cst.FunctionDef, marker: str | None = None) -> bool:
    """True when the function already runs side work (a second apply is a no-op): it calls
    msrewrite helpers, or, for one branch of a several-stream case, carries that branch's marker."""
    found = False

    class _Seen(Visitor):
        def visit_Name(self, node: cst.Name) -> None:
            nonlocal found
            if marker is None and node.value.startswith(HELPER_PREFIX):
                found = True

        def visit_Comment(self, node: cst.Comment) -> None:
            nonlocal found
            if (marker or "# msrewrite(") in node.value:
                found = True

    func.visit(_Seen())
    return found


def self_attrs(node: cst.CSTNode) -> set[str]:
    """Every `self.<attr>` the node reads or writes."""
    attrs: set[str] = set()

    class _Attrs(Visitor):
        def visit_Attribute(self, n: cst.Attribute) -> None:
            if isinstance(n.value, cst.Name) and n.value.value == "self":
                attrs.add(n.attr.value)

    node.visit(_Attrs())
    return attrs


def assigned_self_attrs(func: cst.FunctionDef) -> set[str]:
    names: set[str] = set()

    class _Assigned(Visitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            t = node.target
            if isinstance(t, cst.Attribute) and isinstance(t.value, cst.Name) and t.value.value == "self":
                names.add(t.attr.value)

    func.visit(_Assigned())
    return names


def _assigned_nested(func: cst.FunctionDef, attr: str, top_level: int) -> bool:
    """`self.<attr>` is assigned more often than the `top_level` plain statements seen (in an `if`, a loop)."""
    count = 0

    class _Count(Visitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            nonlocal count
            count += dotted_name(node.target) == f"self.{attr}"

    func.body.visit(_Count())
    return count != top_level


def contains(node: cst.CSTNode, target: cst.CSTNode) -> bool:
    """`target` (by identity) is `node` or lies inside it."""
    hit = False

    class _Find(Visitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            nonlocal hit
            hit = hit or n is target
            return not hit

    node.visit(_Find())
    return hit


def bound_on_every_path(node: cst.BaseStatement) -> set[str]:
    """Names a statement binds to a computed value whenever it runs (an `if` binds on some
    paths only; `shared = None` binds no tensor)."""
    if isinstance(node, cst.BaseCompoundStatement):
        return set()
    if isinstance(node, cst.SimpleStatementLine) and len(node.body) == 1 and isinstance(node.body[0], cst.Assign):
        value = node.body[0].value
        if isinstance(value, (cst.Integer, cst.Float, cst.SimpleString)) or (
            isinstance(value, cst.Name) and value.value in ("None", "True", "False")
        ):
            return set()
    return node_facts(node).stores


# Classes and their constructors ---------------------------------------------------------------
def init_info(cls: cst.ClassDef | None, flag_names: tuple[str, ...]):
    """(__init__, its config parameter, whether it already assigns any of `flag_names`)."""
    stmt = kept_method(cls, "__init__")
    if stmt is None:
        return None, None, False
    params = [p.name.value for p in stmt.params.params]
    config = "config" if "config" in params else None
    sets_flag = bool(set(flag_names) & assigned_self_attrs(stmt))
    return stmt, config, sets_flag


def _init_assignments(init: cst.FunctionDef) -> dict[str, list[cst.BaseExpression]]:
    """attr -> the values `__init__` assigns to `self.<attr>` in its top-level statements."""
    assigned: dict[str, list[cst.BaseExpression]] = {}
    for stmt in init.body.body:  # type: ignore[union-attr]  # a class's __init__ found by init_info
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None:
                targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
                for target in targets:
                    name = dotted_name(target) or ""
                    if name.startswith("self.") and name.count(".") == 1:
                        assigned.setdefault(name[5:], []).append(small.value)
    return assigned


def init_layers(init: cst.FunctionDef | None) -> dict[str, str]:
    """attr -> the dotted constructor of every value `__init__` assigns to `self.<attr>` (`nn.Linear`),
    where that is one constructor call."""
    if init is None or not isinstance(init.body, cst.IndentedBlock):
        return {}
    layers: dict[str, str] = {}
    for attr, values in _init_assignments(init).items():
        ctors = {dotted_name(v.func) if isinstance(v, cst.Call) else None for v in values}
        if len(ctors) == 1 and None not in ctors:
            layers[attr] = ctors.pop() or ""
    return layers


def _is_stream_value(value: cst.BaseExpression, api: str, params: dict[str, cst.Param]) -> bool:
    """`<api>.Stream()`, `... if c else None`, or a constructor argument named like a stream that
    is not annotated as the other API family's."""
    if isinstance(value, cst.IfExp):
        branches = (value.body, value.orelse)
        return all(
            _is_stream_value(v, api, params) or (isinstance(v, cst.Name) and v.value == "None") for v in branches
        ) and not all(isinstance(v, cst.Name) for v in branches)
    if isinstance(value, cst.Call):
        return dotted_name(value.func) == f"{api}.Stream"
    if isinstance(value, cst.Name) and value.value in params and "stream" in value.value:
        note = params[value.value].annotation
        other = "torch.npu" if api == "torch.cuda" else "torch.cuda"
        return note is None or other not in _EMPTY.code_for_node(note.annotation)
    return False


def model_stream(cls: cst.ClassDef | None, init: cst.FunctionDef | None, plan: OverlapPlan) -> str:
    """`alt_stream` when the class already holds a side stream of the plan's API family in
    `self.alt_stream`: made in `__init__` (`torch.cuda.Stream()`, also `... if c else None`) or
    handed in as a constructor argument (`alt_stream=None`, SGLang's layers), and never
    reassigned elsewhere in the class. The edit then runs on that stream instead of a second one.
    Only the plain wait_stream modes (eager, cuda) with a lazily made stream reuse it."""
    if (
        cls is None
        or init is None
        or plan.mode not in ("eager", "cuda")
        or plan.stream_source != "lazy"
        or plan.sync != "wait_stream"
        or plan.core_limits
        or not isinstance(cls.body, cst.IndentedBlock)
    ):
        return ""
    api = "torch.cuda" if plan.mode == "cuda" else "torch.npu"
    params = {p.name.value: p for p in (*init.params.params, *init.params.kwonly_params)}
    elsewhere = set().union(
        *(assigned_self_attrs(m) for m in cls.body.body if isinstance(m, cst.FunctionDef) and m is not init)
    )
    for attr, values in _init_assignments(init).items():
        if (
            "stream" in attr
            and attr not in elsewhere
            and all(_is_stream_value(v, api, params) for v in values)
            and not _assigned_nested(init, attr, len(values))
        ):
            return attr
    return ""


def class_inits(module: cst.Module) -> dict[str, cst.FunctionDef]:
    inits: dict[str, cst.FunctionDef] = {}
    for _name, func, cls in iter_functions(module):
        if cls is not None and func.name.value == "__init__":
            inits[cls.name.value] = func
    return inits


def constructed_classes(func: cst.CSTNode, names: set[str]) -> set[str]:
    """The classes among `names` that `func` (or any node) calls, i.e. constructs."""
    found: set[str] = set()

    class _Calls(Visitor):
        def visit_Call(self, call: cst.Call) -> None:
            if isinstance(call.func, cst.Name) and call.func.value in names:
                found.add(call.func.value)

    func.visit(_Calls())
    return found


# Module level ---------------------------------------------------------------------------------
def is_import(stmt: cst.BaseStatement) -> bool:
    if isinstance(stmt, cst.SimpleStatementLine):
        return all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)
    if isinstance(stmt, cst.Try) and isinstance(stmt.body, cst.IndentedBlock):
        return all(is_import(s) for s in stmt.body.body)
    return False


def _import_bindings(stmt: cst.BaseStatement) -> set[str]:
    """The names an import statement (or a `try:` of them, see is_import) binds."""
    bound: set[str] = set()
    lines = [stmt] if isinstance(stmt, cst.SimpleStatementLine) else list(stmt.body.body)  # type: ignore[attr-defined]  # a `try:` (is_import)
    for line in lines:
        for imp in line.body:
            if not isinstance(imp, (cst.Import, cst.ImportFrom)) or isinstance(imp.names, cst.ImportStar):
                continue
            for alias in imp.names:
                if alias.asname is not None:
                    bound.add(_EMPTY.code_for_node(alias.asname.name))
                else:
                    bound.add(_EMPTY.code_for_node(alias.name).split(".")[0])
    return bound


def top_level_bindings(module: cst.Module) -> set[str]:
    bound: set[str] = set()
    for stmt in module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            bound.add(stmt.name.value)
        elif is_import(stmt):
            bound |= _import_bindings(stmt)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Assign):
                    bound.update(t.target.value for t in small.targets if isinstance(t.target, cst.Name))
    return bound


def imports_module(module: cst.Module, name: str) -> bool:
    """A top-level `import <name>` (not `as` another name)."""
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for imp in stmt.body:
                if isinstance(imp, cst.Import) and any(
                    _EMPTY.code_for_node(alias.name) == name and alias.asname is None for alias in imp.names
                ):
                    return True
    return False
