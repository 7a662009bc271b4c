"""No function in msrewrite/ is over 80 lines (#15): a long function is a sequence of steps that
wants names. Complexity (15 at most) is ruff's C901, run by .ci/run."""

from __future__ import annotations

import ast

from helpers import ROOT

MAX_LINES = 80


def long_functions(root=ROOT / "msrewrite") -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_function_in_msrewrite_is_over_80_lines():
    assert long_functions() == []


def test_the_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert long_functions(tmp_path) != []
