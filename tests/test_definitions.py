"""The definition Python keeps (analyze/definitions.py): a second `def` of a name replaces the first.

A target, a method summary or an inlined method read from the dead first definition reads code
that never runs: the edit does nothing at run time, or a write the running method makes is
missed. tests/adversarial/dead_helper_def*.py hold the verify-backed pair; here the lookups.
"""

from __future__ import annotations

import libcst as cst
import pytest

from helpers import ROOT
from msrewrite.analyze.definitions import kept_method, last_def, shadowed_defs
from msrewrite.analyze.outline import iter_functions
from msrewrite.analyze.positions import def_lines
from msrewrite.errors import NothingToDo


def _class(code: str) -> cst.ClassDef:
    node = cst.parse_module(code).body[0]
    assert isinstance(node, cst.ClassDef)
    return node


def _dead_lines(code: str) -> list[int]:
    """The `def` lines shadowed_defs calls dead, in the module body and in each class body."""
    module = cst.parse_module(code)
    dead = shadowed_defs(module.body)
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef):
            dead |= shadowed_defs(stmt.body.body)
    found = [n for n, line in enumerate(code.splitlines(), start=1) if line.lstrip().startswith("def ")]
    defs: list[cst.FunctionDef] = []  # every def in source order, as `found` lists their lines

    class _Defs(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            defs.append(node)

    module.visit(_Defs())
    return [line for line, node in zip(found, defs, strict=True) if id(node) in dead]


@pytest.mark.parametrize(
    "code, dead",
    [
        ("class A:\n    def f(self): pass\n    def f(self): pass\n", [2]),
        ("class A:\n    def f(self): pass\n    f = staticmethod(len)\n", [2]),
        ("class A:\n    def f(self): pass\n    del f\n", [2]),
        ("class A:\n    def f(self): pass\n    from x import f\n", [2]),
        ("class A:\n    def f(self): pass\n    g, f = 1, 2\n", [2]),
        ("class A:\n    def f(self): pass\n    if X:\n        def f(self): pass\n", [2]),  # may be replaced
        ("class A:\n    if X:\n        def f(self): pass\n    else:\n        def f(self): pass\n", []),  # alternatives
        ("class A:\n    if X:\n        def f(self): pass\n    def f(self): pass\n", [3]),
        ("class A:\n    def f(self): pass\n    def g(self): pass\n", []),
        ("class A:\n    def f(self):\n        f = 1\n        return f\n", []),  # a local, not the class's
        ("def f(): pass\ndef f(): pass\n", [1]),
    ],
)
def test_shadowed_defs(code, dead):
    assert _dead_lines(code) == dead


def test_kept_method_is_the_last_def_and_none_when_rebound_otherwise():
    two = _class("class A:\n    def f(self):\n        return 1\n    def f(self):\n        return 2\n")
    kept = kept_method(two, "f")
    assert kept is not None and kept is two.body.body[1]
    assert kept_method(_class("class A:\n    def f(self): pass\n    f = None\n"), "f") is None
    assert kept_method(_class("class A:\n    def g(self): pass\n"), "f") is None
    assert last_def(two.body.body, "f") is two.body.body[1]


def test_targets_and_def_lines_are_the_kept_definition():
    code = "class A:\n    def forward(self, x):\n        return x\n\n    def forward(self, x):\n        return x + 1\n"
    found = [(name, func.body.body[0]) for name, func, _ in iter_functions(cst.parse_module(code))]
    assert len(found) == 1 and found[0][0] == "A.forward"
    assert "x + 1" in cst.Module(body=[]).code_for_node(found[0][1])
    assert def_lines(code)["A.forward"] == 5


def test_a_write_in_the_kept_helper_refuses_and_one_in_the_dead_helper_does_not(tmp_path):
    """The must-refuse / must-edit pair without verify (tests/test_adversarial.py runs both
    through verify): the summary of `self.scale` is the second definition's."""
    from test_effects import edit

    unsafe = (ROOT / "tests" / "adversarial" / "dead_helper_def.py").read_text()
    with pytest.raises(NothingToDo, match=r"writes 'x' in place.*self\.scale"):
        edit(tmp_path, unsafe)
    safe = (ROOT / "tests" / "adversarial" / "dead_helper_def_safe.py").read_text()
    plan, edited, _ = edit(tmp_path, safe)
    assert plan.function == "Block.forward"
    assert "shared_expert_stream" in edited.read_text()
