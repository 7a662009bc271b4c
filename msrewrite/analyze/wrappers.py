"""A `with` around a function's whole body whose enter and exit neither order nor free tensors
(`torch.autocast`, `torch.no_grad`, `torch.inference_mode`, `torch.profiler.record_function`):
when it holds both the fork and the join, the edit goes inside it and nothing needs splitting.

The analysis (analyze/branch.py) and the emitter (emit/function_edit.py) both see the function
with the `with`'s block spliced in its place (`flattened`); the emitter puts the edited block
back into the `with` (`rewrapped`). Any other context manager keeps the function as written.
"""

from __future__ import annotations

import libcst as cst

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


def _is_docstring(stmt: cst.BaseStatement) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and len(stmt.body) == 1
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))
    )


def wrapping_with(func: cst.FunctionDef) -> tuple[int, cst.With] | None:
    """(its index in the body, the `with`) when the function's body is, after an optional
    docstring, one `with` of TRANSPARENT_CONTEXTS calls (and statements after it); else None."""
    if not isinstance(func.body, cst.IndentedBlock):
        return None
    body = list(func.body.body)
    at = 1 if body and _is_docstring(body[0]) else 0
    if at >= len(body):
        return None
    node = body[at]
    if not isinstance(node, cst.With) or node.asynchronous is not None or not isinstance(node.body, cst.IndentedBlock):
        return None
    for item in node.items:
        if not (isinstance(item.item, cst.Call) and dotted(item.item.func) in TRANSPARENT_CONTEXTS):
            return None
    return at, node


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
