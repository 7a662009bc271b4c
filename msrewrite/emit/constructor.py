"""The edit's changes to constructors: the lines a strategy adds to the class's `__init__` (the
switch, npugraph-ex streams and events), and a side stream handed down from the outermost model
class that builds the edited layer (`--stream-source constructor`)."""

from __future__ import annotations

import libcst as cst

from msrewrite.analyze.outline import class_inits, constructed_classes
from msrewrite.emit.templates import (
    keyword_arg,
    keyword_param,
    leading_lines,
    parse_block,
    strip_leading,
    with_comma,
    with_leading,
)
from msrewrite.plan import OverlapPlan
from msrewrite.validate import literal


def extend_init(
    init: cst.FunctionDef | None, lines: list[str], plan: OverlapPlan, stream_param: str
) -> cst.FunctionDef | None:
    """`init` with the strategy's `lines` at its end (and the handed-down stream's keyword), or
    None when there is nothing to add."""
    if init is None or not lines:
        return None
    block = init.body
    new_init = init.with_changes(body=block.with_changes(body=[*block.body, *parse_block(lines)]))
    if plan.stream_source == "constructor":
        new_init = add_keyword_param(new_init, stream_param)
    return new_init


def add_keyword_param(func: cst.FunctionDef, name: str, default: str = "None") -> cst.FunctionDef:
    """`def __init__(..., name=None)`: keyword-only after *args, else the last positional one."""
    params = func.params
    existing = [p.name.value for p in (*params.params, *params.kwonly_params)]
    if name in existing:
        return func
    param = keyword_param(name, default)
    if isinstance(params.star_arg, cst.Param) or params.kwonly_params:
        return func.with_changes(params=params.with_changes(kwonly_params=[*params.kwonly_params, param]))
    items = list(params.params)
    if items and items[-1].comma is cst.MaybeSentinel.DEFAULT and params.star_kwarg is None:
        items[-1] = with_comma(items[-1])
    if params.star_kwarg is not None:
        param = with_comma(param)
        if items and items[-1].comma is cst.MaybeSentinel.DEFAULT:
            items[-1] = with_comma(items[-1])
    return func.with_changes(params=params.with_changes(params=[*items, param]))


def plumb_constructor_stream(module: cst.Module, target: str, param: str, plan: OverlapPlan) -> cst.Module:
    """Hand the side stream down from the outermost class in the file that builds `target`.

    Every class on the way gets a `param=None` keyword and passes it on; the outermost one (built
    nowhere in this file) creates the stream once, before the statement that builds its layers.
    """
    inits = class_inits(module)
    builds = {cls: constructed_classes(func, set(inits)) for cls, func in inits.items()}
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
    create = f"{param} = _ms_side_stream({literal(plan.stream_tag)}, {_creator_flag(plan)})"
    return module.visit(_Plumb(receivers, creators, target, param, create, plan.case))


def _creator_flag(plan: OverlapPlan) -> str:
    default = "True" if plan.flag.default else "False"
    if plan.flag.kind == "env":
        return f"_ms_env_flag({literal(plan.flag.name)}, {default})"
    if plan.flag.kind == "sglang":
        return f"get_bool_env_var({literal(plan.flag.name)}, {literal(default.lower())})"
    if plan.flag.kind == "vllm-ascend":
        return f"getattr(get_ascend_config(), {literal(plan.flag.name)}, {default})"
    return f"getattr(config, {literal(plan.flag.name)}, {default})"


class _Plumb(cst.CSTTransformer):
    def __init__(
        self, receivers: set[str], creators: set[str], target: str, param: str, create: str, case: str
    ) -> None:
        self.receivers, self.creators, self.target = receivers, creators, target
        self.param, self.create, self.case = param, create, case
        self.classes: list[str] = []
        self.in_init = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node.name.value)

    def leave_ClassDef(self, _original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self.classes.pop()
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.in_init = bool(self.classes) and node.name.value == "__init__"

    def leave_Call(self, _original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        cls = self.classes[-1] if self.classes else None
        if not self.in_init or cls not in (self.receivers | self.creators) - {self.target}:
            return updated_node
        if not (isinstance(updated_node.func, cst.Name) and updated_node.func.value in self.receivers):
            return updated_node
        if any(arg.keyword is not None and arg.keyword.value == self.param for arg in updated_node.args):
            return updated_node
        args = list(updated_node.args)
        if args and args[-1].comma is cst.MaybeSentinel.DEFAULT:
            args[-1] = with_comma(args[-1])
        return updated_node.with_changes(args=[*args, keyword_arg(self.param, self.param)])

    def leave_FunctionDef(self, _original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        cls = self.classes[-1] if self.classes else None
        if not (self.classes and updated_node.name.value == "__init__"):
            return updated_node
        self.in_init = False
        if cls in self.receivers and cls != self.target:
            return add_keyword_param(updated_node, self.param)
        if cls not in self.creators:
            return updated_node
        block = updated_node.body
        assert isinstance(block, cst.IndentedBlock)  # an __init__ that builds a layer
        body = list(block.body)
        at = next((i for i, stmt in enumerate(body) if constructed_classes(stmt, self.receivers)), None)
        if at is None:
            return updated_node
        create = parse_block(
            [
                f"# msrewrite({self.case}): one side stream for every layer, created once with the model.",
                self.create,
            ]
        )
        create = with_leading(create, list(leading_lines(body[at])))
        body[at] = strip_leading(body[at])
        body[at:at] = create
        return updated_node.with_changes(body=block.with_changes(body=body))
