"""Code of a function that never runs on the platform an edit is for.

Serving frameworks keep one function for every platform and branch on platform tests: SGLang's
`_is_npu` / `is_npu()` / `_is_cuda`, vLLM's `current_platform.is_npu()`. Stream code that sits only
in a branch of another platform (an NPU overlap under `if _is_npu:`) is not an overlap of the
path the edit is for, so it does not make the function "already overlapped" there.

Conservative: only the tests below count, as written: a module-level name bound once to one of the
helper calls (`_is_npu = is_npu()`), the call itself, `X and Y` with one of them a test, and a
name bound once (at module level, or at the function's top level) to such a test
(`_use_aiter = get_bool_env_var("SGLANG_USE_AITER") and _is_hip`, `enable_npu_dual_stream =
_is_npu and ...`). A helper's answer is exact: true on its platform and false elsewhere. `X and
<test>` only implies the platform: true on it alone, but it may be false there too.
The body of `if <npu test>:` (and the `else:` of `if not <npu test>:`) never runs for a CUDA edit;
for an NPU edit, the body of `if <cuda test>:` (CUDA, ROCm) never runs, and, for an exact NPU test
only, neither do the body of `if not <npu test>:` and the `else:` of `if <npu test>:`
(`if not (_is_npu and big):` runs on NPU whenever `big` is false).
The CUDA side has no `not`: `not is_cuda()` still holds on ROCm, where torch.cuda streams run too.
"""

from __future__ import annotations

import libcst as cst

from msrewrite.analyze.reach import local_values
from msrewrite.analyze.torch_effects import dotted
from msrewrite.analyze.walk import Visitor, walk


def _nodes(node: cst.CSTNode, kind: type) -> list:
    """Every node of `kind` in `node`, itself included."""
    found: list = []

    class Collect(Visitor):
        def on_visit(self, n: cst.CSTNode) -> bool:
            if isinstance(n, kind):
                found.append(n)
            return True

    walk(node, Collect())
    return found


# helper callee -> the platform it tests for. An edit runs on "cuda" (NVIDIA, or ROCm, which runs
# the torch.cuda stream API) or "npu"; the others are devices with no stream an edit uses (on
# them the edit's helpers fall back to running everything in order).
_HELPERS = {
    "is_npu": "npu",
    "is_npu_arch35": "npu",
    "current_platform.is_npu": "npu",
    "is_cuda": "cuda",
    "is_cuda_alike": "cuda",
    "current_platform.is_cuda": "cuda",
    "current_platform.is_cuda_alike": "cuda",
    "is_hip": "cuda",  # ROCm runs the torch.cuda stream API
    "current_platform.is_rocm": "cuda",
    "is_cpu": "cpu",
    "current_platform.is_cpu": "cpu",
    "is_xpu": "xpu",
    "current_platform.is_xpu": "xpu",
    "is_hpu": "hpu",
    "is_musa": "musa",
    "is_mps": "mps",
    "current_platform.is_tpu": "tpu",
}


def platform_of(mode: str) -> str:
    """The device family an edit in `mode` runs on: "cuda" (torch.cuda, also ROCm) or "npu"."""
    return "cuda" if mode == "cuda" else "npu"


def helper_platform(callee: str) -> str | None:
    """The platform a call of `callee` with no arguments tests for (`is_npu` -> "npu"), or None."""
    return _HELPERS.get(callee)


def _helper_platform(expr: cst.BaseExpression) -> str | None:
    if isinstance(expr, cst.Call) and not expr.args:
        return helper_platform(dotted(expr.func) or "")
    return None


# the mark of a name's platform that its truth only implies (`flag = env and _is_hip`: "cuda?")
IMPLIED = "?"


def implied(kind: str) -> str:
    """The mark of a test true only on platform `kind`, though not always there."""
    return kind.removesuffix(IMPLIED) + IMPLIED


def _test_platform(expr: cst.BaseExpression, names: dict[str, str]) -> tuple[str, bool] | None:
    """(the platform `expr` being true implies, whether it is exact: false on every other
    platform and true on that one), or None. `names`: as module_platform_names, a value ending
    in IMPLIED for a name whose truth only implies its platform."""
    if isinstance(expr, cst.Name):
        kind = names.get(expr.value)
        return None if kind is None else (kind.removesuffix(IMPLIED), not kind.endswith(IMPLIED))
    if isinstance(expr, cst.BooleanOperation) and isinstance(expr.operator, cst.And):
        found = _test_platform(expr.left, names) or _test_platform(expr.right, names)
        return None if found is None else (found[0], False)  # `_is_npu and big` may be false on NPU
    kind = _helper_platform(expr)
    return None if kind is None else (kind, True)


def _local_platform_names(func: cst.FunctionDef, names: dict[str, str]) -> dict[str, str]:
    """Locals bound once, at the function's top level, to a platform test (`flag = _is_npu and ...`)."""
    if not isinstance(func.body, cst.IndentedBlock):
        return {}
    found: dict[str, str] = {}
    for stmt in func.body.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Assign) and len(small.targets) == 1:
                target = small.targets[0].target
                if not isinstance(target, cst.Name) or target.value in names:
                    continue
                bound = local_values(func, target.value)  # bound here only, by this assignment
                test = _test_platform(small.value, names) if isinstance(bound, list) and len(bound) == 1 else None
                if test is not None:
                    found[target.value] = test[0] if test[1] else implied(test[0])
    return found


def other_platform_blocks(func: cst.FunctionDef, mode: str, names: dict[str, str]) -> list[cst.CSTNode]:
    """The blocks of `func` that never run on `mode`'s platform (`names`: packages.module_platform_names)."""
    names = {**names, **_local_platform_names(func, names)}
    ours = platform_of(mode)
    blocks: list[cst.CSTNode] = []

    class Ifs(Visitor):
        def visit_If(self, node: cst.If) -> None:
            test = node.test
            if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
                found = _test_platform(test.expression, names)
                if found is None:
                    return
                kind, exact = found
                if ours == "npu" and kind == "npu" and exact:
                    blocks.append(node.body)  # `if not _is_npu:` never runs on NPU
                elif kind != ours and isinstance(node.orelse, cst.Else):
                    blocks.append(node.orelse.body)  # its `else:` runs on the other platform only
                return
            found = _test_platform(test, names)
            if found is None:
                return
            kind, exact = found
            if kind != ours:
                blocks.append(node.body)
            elif kind == "npu" and ours == "npu" and exact and isinstance(node.orelse, cst.Else):
                blocks.append(node.orelse.body)  # only `else:`, not an `elif`: it may test for NPU again

    walk(func, Ifs())
    return blocks


def outside(calls: list[cst.Call], blocks: list[cst.CSTNode]) -> list[cst.Call]:
    """The calls that lie in none of `blocks`."""
    inside = {id(node) for block in blocks for node in _nodes(block, cst.Call)}
    return [c for c in calls if id(c) not in inside]


def platform_tests(func: cst.FunctionDef, blocks: list[cst.CSTNode]) -> set[str]:
    """The tests (`_is_npu`, `not _is_cpu`) of the `if`s whose branches are `blocks`."""
    ids = {id(block) for block in blocks}
    tests: set[str] = set()

    class Ifs(Visitor):
        def visit_If(self, node: cst.If) -> None:
            orelse = node.orelse.body if isinstance(node.orelse, cst.Else) else None
            if id(node.body) in ids or id(orelse) in ids:
                tests.add(" ".join(cst.Module([]).code_for_node(node.test).split()))

    walk(func, Ifs())
    return tests
