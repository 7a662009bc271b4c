"""``static_mixed_api(source)``: functions whose body calls both torchair and native stream APIs."""

from __future__ import annotations

import ast

from msrewrite.sanitizer.findings import Finding, fmt

_TORCHAIR_CALLS = {
    "npu_stream_switch",
    "npu_wait_tensor",
    "super_kernel",
    "npu_create_tagged_event",
    "npu_tagged_event_record",
    "npu_tagged_event_wait",
    "npu_record_tagged_stream",
    "NpuStreamSwitch",
}
_NATIVE_CALLS = {
    "Stream",
    "Event",
    "stream",
    "current_stream",
    "default_stream",
    "set_stream",
    "wait_stream",
    "wait_event",
    "record_event",
    "record_stream",
    "set_stream_limit",
    "reset_stream_limit",
}
_STREAM_MODULES = ("torch.npu", "torch_npu", "torch.cuda", "npu", "cuda")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return "?"


def _family(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    last = name.rsplit(".", 1)[-1]
    if last in _TORCHAIR_CALLS:
        return "torchair"
    if last == "limit_core_num":  # torchair.scope (GE attribute) vs npugraph_ex.scope (stream cap)
        return "native" if "npugraph_ex" in name else "torchair"
    if last in _NATIVE_CALLS:
        # Stream / Event / stream() only count on a device module; the methods count anywhere.
        if last in ("Stream", "Event", "stream", "current_stream", "default_stream", "set_stream"):
            return "native" if name.rsplit(".", 1)[0].endswith(_STREAM_MODULES) else None
        return "native"
    return None


class _Calls(ast.NodeVisitor):
    """Stream API calls of one function body, not descending into nested functions."""

    def __init__(self):
        self.first: dict[str, tuple[int, str]] = {}

    def visit_Call(self, node: ast.Call) -> None:
        family = _family(node)
        if family and family not in self.first:
            self.first[family] = (node.lineno, _dotted(node.func))
        self.generic_visit(node)

    def visit_FunctionDef(self, node) -> None:
        pass  # nested functions are checked on their own

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef


def static_mixed_api(source: str, filename: str = "<source>") -> list[Finding]:
    findings = []
    for func in ast.walk(ast.parse(source, filename)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = _Calls()
        for statement in func.body:
            calls.visit(statement)
        if len(calls.first) < 2:
            continue
        (tline, tname), (nline, nname) = calls.first["torchair"], calls.first["native"]
        (first_line, first_name), (second_line, second_name) = sorted([(tline, tname), (nline, nname)])
        first, second = (filename, first_line), (filename, second_line)
        findings.append(
            Finding(
                "mixed-api",
                f"{func.name}() mixes {first_name} at {fmt(first)} with {second_name} at "
                f"{fmt(second)}: torchair scope/ops and native torch.npu streams belong to different modes",
                first,
                second,
            )
        )
    return findings
