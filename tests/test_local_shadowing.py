"""A call of a parameter or local is of that object, never of the module's function or import
that has the same name.

`def forward(self, x, scale=None): scale(x)` calls whatever the caller passed; the module-level
`scale` (or `from ops import scale`) the analysis can read says nothing about it. Such a call is
unknown, named as a local, and the edit refuses or protects; the same call of the module's own
function is still seen into and edited.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")

MODEL = """import torch
from torch import nn

IMPORT


def scale(x):
    return x * 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x, SIGNATURE):
        BIND
        s = self.shared_experts(x)
        h = self.experts(CALL(x))
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16), ARGUMENT)
"""

# (import line, extra parameter, a binding in the body, the call, make()'s extra argument)
SHADOWS = {
    "parameter": ("", "scale=None", "pass", "scale", "lambda t: t.mul_(2)"),
    "parameter-of-imported-name": ("from math import sqrt", "sqrt=None", "pass", "sqrt", "lambda t: t.mul_(2)"),
    "module-attribute-parameter": ("import torch.nn.functional as F", "F=None", "pass", "F.relu", "Ops()"),
    "local-in-a-loop": ("", "ops=()", "for scale in ops:\n            pass", "scale", "(lambda t: t.mul_(2),)"),
    "nested-def-name": (
        "",
        "flag=True",
        "if flag:\n            def scale(t):\n                return t.mul_(2)",
        "scale",
        "True",
    ),
}
OPS = "\n\nclass Ops:\n    @staticmethod\n    def relu(t):\n        return t.mul_(2)\n"


def write(tmp_path: Path, kind: str, shadowed: bool) -> Path:
    imported, parameter, bind, call, argument = SHADOWS[kind]
    text = MODEL.replace("IMPORT", imported)
    if shadowed:
        text = text.replace("SIGNATURE", parameter).replace("BIND", bind).replace("ARGUMENT", argument)
    else:  # the module's own function: seen into
        text = text.replace(", SIGNATURE", "").replace("BIND", "pass").replace(", ARGUMENT", "")
        call = "scale"
    text = text.replace("CALL", call) + OPS
    path = tmp_path / f"shadow_{kind.replace('-', '_')}_{'local' if shadowed else 'module'}.py"
    path.write_text(text)
    return path


def edit(path: Path, protect: str = "none"):
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, protect=protect)[-1]


@pytest.mark.parametrize("kind", SHADOWS)
def test_a_local_of_a_modules_name_is_not_the_modules(tmp_path, kind):
    with pytest.raises(NothingToDo) as refused:
        edit(write(tmp_path, kind, shadowed=True))
    why = str(refused.value)
    if kind == "nested-def-name":  # a nested def is read as a closure: its write is seen
        assert "writes 'x' in place" in why, why
    else:
        assert "a local or parameter" in why and "may write 'x'" in why, why
    protected = edit(write(tmp_path, kind, shadowed=True), protect="auto")
    assert protected.plans[0].protect_inputs == ("x",)


def test_the_modules_own_function_is_still_seen_into(tmp_path):
    step = edit(write(tmp_path, "parameter", shadowed=False))
    assert step.plans[0].trust_boundary == () and step.plans[0].protect_inputs == ()


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize("kind", ["parameter", "module-attribute-parameter"])
def test_the_protected_edit_verifies_and_the_unprotected_one_races(tmp_path, kind):
    path = write(tmp_path, kind, shadowed=True)
    step = edit(path, protect="auto")
    edited = tmp_path / f"{path.stem}_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems


MODULE_CALL = """import torch
from torch import nn

import shadow_ops as ops


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)
        y = self.experts(x)
        ops.add(x, y)
        return y + s
"""


@pytest.mark.parametrize("writes", [True, False])
def test_a_modules_function_named_like_a_tensor_method_is_read_not_guessed(tmp_path, writes):
    """`ops.add(out, x)` is the module's `add` (vLLM's `_custom_ops` style), not `Tensor.add`."""
    body = "out.add_(x)" if writes else "return out + x"
    (tmp_path / "shadow_ops.py").write_text(f"def add(out, x):\n    {body}\n")
    path = tmp_path / "module_call_block.py"
    path.write_text(MODULE_CALL)
    if writes:
        with pytest.raises(NothingToDo) as refused:
            edit(path)
        assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value
    else:
        assert edit(path).plans[0].protect_inputs == ()
