"""A top-level `with` whose enter and exit neither order nor free tensors (`torch.autocast`,
`torch.no_grad`, `torch.inference_mode`, `torch.profiler.record_function`): an edit whose join
falls inside it goes inside it, with the fork inside it too or, when the side work runs before
the `with`, before it.

The analysis (analyze/branch.py) and the emitter (emit/function_edit.py) both see the function
with the `with`'s block spliced in its place (`flattened`); the emitter puts the edited block
back into the `with` (`rewrapped`). Any other context manager keeps the function as written, and
a join that would fall inside it is refused naming it.

Side work keeps the context it ran in: side statements inside the `with` fork inside it; side
statements before it fork before it only when the context does not change what any statement
computes (NEUTRAL_CONTEXTS): verify's late schedule issues deferred side work inside the window,
and under autocast or no_grad that work would compute something else there.
"""

from __future__ import annotations

import libcst as cst
from libcst.metadata import CodeRange

from msrewrite.analyze.torch_effects import dotted

# context managers that only set thread-local modes (autocast dtype, grad mode) or mark a profiler
# range: streams, events and tensor lifetimes are as without them
TRANSPARENT_CONTEXTS = frozenset(
    {
        "torch.autocast",
        "torch.amp.autocast",
        "torch.cuda.amp.autocast",
        "torch.no_grad",
        "torch.inference_mode",
        "torch.profiler.record_function",
        "torch.autograd.profiler.record_function",
    }
)
# those of them that change nothing a statement computes: a profiler range
NEUTRAL_CONTEXTS = frozenset({"torch.profiler.record_function", "torch.autograd.profiler.record_function"})


def _is_docstring(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def _contexts(node: cst.With) -> list[str]:
    """The dotted callee of each item (`torch.no_grad` for `torch.no_grad()`), "" for an item that
    is not a call of a dotted name (`with sp_ctx:`)."""
    return [dotted(item.item.func) or "" if isinstance(item.item, cst.Call) else "" for item in node.items]


def is_transparent(node: cst.With) -> bool:
    """Every item one of TRANSPARENT_CONTEXTS, none binding a name (`as x` would be lost when flattened)."""
    return all(name in TRANSPARENT_CONTEXTS for name in _contexts(node)) and all(
        item.asname is None for item in node.items
    )


def is_neutral(node: cst.With) -> bool:
    return all(name in NEUTRAL_CONTEXTS for name in _contexts(node))


def opaque_context(node: cst.With) -> str:
    """The source of the first item msrewrite cannot see through (`sp_ctx`, `use_symmetric_memory(...)`)."""
    for item, name in zip(node.items, _contexts(node), strict=True):
        if name not in TRANSPARENT_CONTEXTS:
            return " ".join(cst.Module([]).code_for_node(item.item).split())
    return ""


def top_level_withs(func: cst.FunctionDef) -> list[tuple[int, cst.With]]:
    """(index in the body, the `with`) of each top-level synchronous `with` with an indented block."""
    if not isinstance(func.body, cst.IndentedBlock):
        return []
    return [
        (at, node)
        for at, node in enumerate(func.body.body)
        if isinstance(node, cst.With) and node.asynchronous is None and isinstance(node.body, cst.IndentedBlock)
    ]


def wrapping_with(func: cst.FunctionDef) -> tuple[int, cst.With] | None:
    """(its index in the body, the `with`) when the function's body is, after an optional
    docstring, one `with` of TRANSPARENT_CONTEXTS calls (and statements after it); else None."""
    if not isinstance(func.body, cst.IndentedBlock):
        return None
    body = list(func.body.body)
    at = 1 if body and _is_docstring(body[0]) else 0
    found = next(((k, node) for k, node in top_level_withs(func) if k == at), None)
    return found if found is not None and is_transparent(found[1]) else None


def placement(
    node: cst.With,
    span: CodeRange,
    is_last: bool,
    fork_line: int,
    join_line: int | None,
    side_lines: list[int],
) -> str | None:
    """Where an edit with these lines stands to the `with` (`span` its lines; `join_line` None when
    the join falls off the function's end): "inside" (fork and join in its block), "before" (the
    side work and the fork before it, the join in its block), or None (the edit does not go into
    this `with`)."""

    def inside(line: int) -> bool:
        return span.start.line < line <= span.end.line

    join_inside = inside(join_line) if join_line is not None else is_last
    if not join_inside:
        return None
    if inside(fork_line):
        return "inside" if all(inside(line) for line in side_lines) else None
    if fork_line < span.start.line and all(line < span.start.line for line in side_lines) and is_neutral(node):
        return "before"
    return None


def flattened(func: cst.FunctionDef, at: int, node: cst.With) -> cst.FunctionDef:
    """`func` with the `with`'s block in place of the `with` (the very statement nodes)."""
    assert isinstance(func.body, cst.IndentedBlock) and isinstance(node.body, cst.IndentedBlock)
    body = list(func.body.body)
    return func.with_changes(body=func.body.with_changes(body=[*body[:at], *node.body.body, *body[at + 1 :]]))


def rewrapped(func: cst.FunctionDef, at: int, node: cst.With, after: list[cst.BaseStatement]) -> cst.FunctionDef:
    """The edited flattened `func` with everything from `at` up to the first of `after` (the
    statements that followed the `with`, the very nodes) back inside the `with`."""
    assert isinstance(func.body, cst.IndentedBlock) and isinstance(node.body, cst.IndentedBlock)
    body = list(func.body.body)
    end = next((k for k, stmt in enumerate(body) if after and stmt is after[0]), len(body))
    inner = node.with_changes(body=node.body.with_changes(body=body[at:end]))
    return func.with_changes(body=func.body.with_changes(body=[*body[:at], inner, *body[end:]]))
