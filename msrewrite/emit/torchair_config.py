"""ge-graph: route the file's torchair CompilerConfig through _ms_torchair_config where the
backend is built, so the side stream and its start gates follow the mode the graph is really
compiled in (torchair has no public "inside a GE graph" predicate; see helpers.GUARDED_IMPORTS)."""

from __future__ import annotations

import libcst as cst

from msrewrite.analyze.walk import Visitor

RECORDER = "_ms_torchair_config"


def _callee(call: cst.Call) -> str:
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    return func.value if isinstance(func, cst.Name) else ""


class _RecordConfig(cst.CSTTransformer):
    def leave_Call(self, _original: cst.Call, updated: cst.Call) -> cst.Call:
        if _callee(updated) != "get_npu_backend":
            return updated
        args = list(updated.args)
        for i, arg in enumerate(args):
            if arg.keyword is None or arg.keyword.value != "compiler_config":
                continue
            value = arg.value
            if isinstance(value, cst.Call) and _callee(value) == RECORDER:
                return updated  # already recorded (the edit is applied again)
            args[i] = arg.with_changes(value=cst.Call(func=cst.Name(RECORDER), args=[cst.Arg(value=value)]))
            return updated.with_changes(args=args)
        return updated


def record_torchair_config(module: cst.Module) -> cst.Module:
    """Wrap every get_npu_backend(compiler_config=X) argument as _ms_torchair_config(X)."""
    return module.visit(_RecordConfig())


class _FindRecorded(Visitor):
    def __init__(self) -> None:
        self.found = False

    def visit_Call(self, node: cst.Call) -> None:
        if _callee(node) == "get_npu_backend":
            self.found |= any(
                arg.keyword is not None
                and arg.keyword.value == "compiler_config"
                and isinstance(arg.value, cst.Call)
                and _callee(arg.value) == RECORDER
                for arg in node.args
            )


def records_config(code: str) -> bool:
    """Whether edited code hands its torchair backend's CompilerConfig to the recorder."""
    finder = _FindRecorded()
    cst.parse_module(code).visit(finder)
    return finder.found
