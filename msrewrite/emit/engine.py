"""Carry out plans on a libcst module: each plan on its function (emit/function_edit.py), the
constructors it extends (emit/constructor.py), then the module's helpers and imports
(emit/module_helpers.py). A prefill-microbatch plan has its own emitter (emit/microbatch.py);
schedule variants (emit/schedules.py) and profiler markers (emit/markers.py) build on this one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import libcst as cst

from msrewrite.analyze.positions import positions_for
from msrewrite.emit.constructor import plumb_constructor_stream
from msrewrite.emit.function_edit import PlannedEdit, plan_edit, unwrapped_edit
from msrewrite.emit.locate import locate
from msrewrite.emit.module_helpers import add_helpers
from msrewrite.errors import BadInput
from msrewrite.plan import MicrobatchPlan, OverlapPlan

__all__ = ["PlannedEdit", "apply_plans", "case_words", "plan_edit"]


def case_words(case_name: str, branch: str = "", placement: str = "shared") -> tuple[str, str]:
    """(side work, main work) as the case's comments name them; a routed placement (plan.py) puts
    the case's main work on the side stream and its own side work on the current one."""
    from msrewrite.cases import get_case

    case = get_case(case_name)
    if case is None:
        return ("the side branch", "the main path")
    spec = next((b for b in case.branches if b.name == branch), None)
    what = (spec.what, case.what[1]) if spec is not None else case.what
    return (f"{what[1]}' work" if what[1].endswith("s") else what[1], what[0]) if placement == "routed" else what


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

    def on_leave(self, original_node, updated_node):
        if isinstance(original_node, cst.FunctionDef):
            return self.replacements.get(id(original_node), updated_node)
        return updated_node


def _replacements(edits: list[PlannedEdit]) -> dict[int, cst.FunctionDef]:
    """id(old definition) -> its new one; an `__init__` two plans extend gets both plans' lines."""
    replacements: dict[int, cst.FunctionDef] = {id(e.old_func): unwrapped_edit(e) for e in edits}
    for edit in edits:
        old, new = edit.old_init, edit.new_init
        if old is None or new is None:
            continue
        added = new.body.body[len(old.body.body) :]
        base = replacements.get(id(old), old)
        replacements[id(old)] = base.with_changes(
            params=new.params if new.params is not old.params else base.params,
            body=base.body.with_changes(body=[*base.body.body, *added]),
        )
    return replacements


def apply_plans(
    module: cst.Module,
    plans: Sequence[OverlapPlan | MicrobatchPlan],
    text: str | None = None,
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
    return _apply_overlap_plans(module, cast("list[OverlapPlan]", plans), text, reschedule)


def _apply_overlap_plans(
    module: cst.Module,
    plans: list[OverlapPlan],
    text: str | None,
    reschedule: Callable[[PlannedEdit], cst.FunctionDef] | None,
) -> cst.Module:
    modes = {p.mode for p in plans}
    if len(modes) > 1:
        raise BadInput(f"plans for one file must share one execution mode, got {', '.join(sorted(modes))}")
    edits = []
    for plan in plans:
        located = locate(module, plan.function)
        positions = positions_for(module, plan.function, located.func, text)
        edits.append(plan_edit(module, positions, plan, text, case_words(plan.case, plan.case_branch, plan.placement)))
        if reschedule is not None:
            edits[-1].new_func = reschedule(edits[-1])
    functions = [e.old_func for e in edits]
    if len(set(map(id, functions))) != len(functions):
        raise BadInput("two plans edit the same function; apply them one at a time")
    new = module.visit(_ReplaceFunctions(module, _replacements(edits)))
    for edit in edits:
        if edit.plan.stream_source == "constructor" and edit.cls is not None and edit.new_init is not None:
            new = plumb_constructor_stream(new, edit.cls.name.value, edit.stream_param, edit.plan)
    new = add_helpers(new, [e.emission for e in edits], plans[0].mode)
    if any(p.markers for p in plans):  # apply --markers: profiler ranges, added by a pass of their own
        from msrewrite.emit import markers

        new = cst.parse_module(markers.add(new.code, [p for p in plans if p.markers]))
    return new
