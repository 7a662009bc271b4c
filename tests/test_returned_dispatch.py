"""A method called on what a function returns (`get_backend().run(x)`; SGLang's
`get_bf16_gemm_backend().is_cutedsl()`, `get_tp_group().all_reduce(...)`): where the function
declares the class it returns (`def get_backend() -> Backend`), the call runs the method of that
class or of any subclass of it in the package (analyze/dispatch.py, as for an attribute whose
class is known by its base).

The framework is a package `fw` in the test's folder; the writing subclass lives in a module of it
that nothing imports (`fw/extra/fast.py`): only the search of the package's tree finds it. A
must-see model (the subclass writes the side branch's input: the case refuses, and the forced
overlap races under verify) and a must-not-overclaim twin (every subclass is pure: the case edits,
its trust boundary saying the union was over the package's subclasses, and the edit verifies clean).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.verify import verify_files
from test_reach import edit, forced

BACKEND = """class Backend:
    def run(self, x):
        return x * 2


_CURRENT = [Backend()]


def get_backend() RETURNS:
    return _CURRENT[0]
"""

FAST = """from fw.backend import Backend


class FastBackend(Backend):
    def run(self, x):
        return BODY
"""
WRITES, PURE = "x.mul_(2)", "x * 2"

MODEL = """import torch
from torch import nn

from fw.backend import get_backend


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)

    def forward(self, x):
        return self.w(get_backend().run(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = Experts()

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(x)
        return h + s


def make():
    import fw.backend
    import fw.extra.fast

    fw.backend._CURRENT[0] = fw.extra.fast.FastBackend()
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""


def write(tmp_path: Path, writing: bool, name: str = "fw", returns: str = '-> "Backend | None"') -> Path:
    package = tmp_path / name
    (package / "extra").mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "extra" / "__init__.py").write_text("")
    (package / "backend.py").write_text(BACKEND.replace(" RETURNS", f" {returns}" if returns else ""))
    fast = FAST.replace("BODY", WRITES if writing else PURE)
    (package / "extra" / "fast.py").write_text(fast.replace("from fw.", f"from {name}."))
    path = tmp_path / f"returned_{'writes' if writing else 'pure'}.py"
    path.write_text(MODEL.replace("fw.", f"{name}."))
    return path


def test_a_writing_subclass_of_the_returned_class_is_seen(tmp_path):
    with pytest.raises(NothingToDo) as refused:
        edit(write(tmp_path, writing=True))
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value
    assert "not visible to msrewrite" not in str(refused.value)


def test_pure_subclasses_of_the_returned_class_are_proved_pure(tmp_path):
    step = edit(write(tmp_path, writing=False))
    plan = step.plans[0]
    assert plan.protect_inputs == ()
    (note,) = plan.trust_boundary  # the closed world, said where a reviewer reads it
    assert "get_backend() (an instance of Backend, by the return annotation of get_backend" in note, note
    assert "union over Backend and its 1 subclass in package fw" in note, note


@pytest.mark.parametrize("returns", ["", "-> object"])
def test_a_function_declaring_no_class_keeps_the_call_unseen(tmp_path, returns):
    with pytest.raises(NothingToDo) as refused:
        edit(write(tmp_path, writing=False, returns=returns))
    assert "get_backend().run (not visible to msrewrite)" in str(refused.value), refused.value


@pytest.mark.slow  # runs the models through verify
def test_verify_agrees(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    pure = write(tmp_path, writing=False, name="fw_returned_pure")
    step = edit(pure)
    edited = tmp_path / "pure_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=pure, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems
    writing = write(tmp_path, writing=True, name="fw_returned_writes")
    text, source = forced(writing)
    raced = tmp_path / "writes_ms.py"
    raced.write_text(text)
    result = verify_files(raced, original=writing, schedule_source=source)
    assert not result.ok, "the forced overlap of the writing twin verified clean"


def test_a_vouched_method_name_is_still_the_reviewers(tmp_path):
    from msrewrite.commands.apply import case_steps
    from msrewrite.load import load
    from test_reach import FLAG

    path = write(tmp_path, writing=True)
    src = load(path)
    step = case_steps(
        path,
        src.text,
        src.module,
        "moe-shared-expert",
        "eager",
        None,
        FLAG,
        None,
        protect="none",
        assume_pure=("get_backend().run",),
    )[-1]
    assert step.plans[0].assume_pure == ("get_backend().run",), step.plans[0]
