"""A @classmethod or @staticmethod called on its class (`Cls.method(x)`; SGLang's
`_DpGatheredBufferWrapper.is_dp_max_padding()`): msrewrite reads the method's body, from this file
or a module the class is imported from. A classmethod's `cls` is the class object: what the body
does to it is done to that object. An instance method called on the class, a method the file
patches, or a class msrewrite cannot read keeps the call "may write".

Each way of reaching the method has a must-see model (the method writes the side branch's input:
the case refuses, and the forced overlap races under verify) and a must-not-overclaim twin (the
method is pure: the case edits without a snapshot, and the edit verifies clean).
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from msrewrite.analyze.summaries import ModuleSummaries
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.verify import verify_files
from test_reach import edit, forced

HELPERS = """import torch


class Scaler:
    factor = 2.0
    count = 0

    @classmethod
    def scale(cls, x):
        return CLASSMETHOD

    @classmethod
    def bump(cls, x):
        cls.count = cls.count + 1
        return x

    @staticmethod
    def shift(x):
        return STATICMETHOD

    def plain(self, x):
        return x * 2
"""
BODIES = {
    "CLASSMETHOD": ("x.mul_(cls.factor)", "x * cls.factor"),
    "STATICMETHOD": ("x.add_(1)", "x + 1"),
}

MODEL = """import torch
from torch import nn

IMPORT


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)

    def forward(self, x):
        return self.w(CALL)


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
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""

# kind -> (the call, whether the class is imported from the package or defined in the model)
KINDS = {
    "classmethod-imported": ("Scaler.scale(x)", True),
    "staticmethod-imported": ("Scaler.shift(x)", True),
    "classmethod-own": ("Scaler.scale(x)", False),
    "staticmethod-own": ("Scaler.shift(x)", False),
}


def helpers(writing: bool) -> str:
    text = HELPERS
    for mark, (writes, pure) in BODIES.items():
        text = text.replace(mark, writes if writing else pure)
    return text


def write(tmp_path: Path, kind: str, writing: bool, name: str = "fw", extra: str = "") -> Path:
    call, imported = KINDS[kind]
    if imported:
        package = tmp_path / name
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("")
        (package / "helpers.py").write_text(helpers(writing) + extra)
        text = MODEL.replace("IMPORT", f"from {name}.helpers import Scaler")
    else:
        own = helpers(writing).removeprefix("import torch\n") + extra
        text = MODEL.replace("IMPORT\n", own)
    path = tmp_path / f"{kind.replace('-', '_')}_{'writes' if writing else 'pure'}.py"
    path.write_text(text.replace("CALL", call))
    return path


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_writing_class_level_method_is_seen(tmp_path, kind):
    with pytest.raises(NothingToDo) as refused:
        edit(write(tmp_path, kind, writing=True))
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value
    assert "not visible to msrewrite" not in str(refused.value)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_pure_class_level_method_is_proved_pure(tmp_path, kind):
    step = edit(write(tmp_path, kind, writing=False))
    assert step.plans[0].protect_inputs == ()
    assert not any("not seen" in line or "not visible" in line for line in step.plans[0].trust_boundary)


# what keeps `Cls.method(...)` unseen: the method is no class-level one, or the file replaces it
UNSEEN = {
    "instance-method": ("Scaler.plain(Scaler(), x)", ""),
    "patched": ("Scaler.shift(x)", "\n\ndef _shift(x):\n    return x.add_(1)\n\n\nScaler.shift = _shift\n"),
}


@pytest.mark.parametrize("kind", list(UNSEEN))
def test_what_is_not_a_class_level_method_stays_unseen(tmp_path, kind):
    call, extra = UNSEEN[kind]
    path = write(tmp_path, "staticmethod-own", writing=False, extra=extra)
    path.write_text(path.read_text().replace("Scaler.shift(x))", f"{call})"))
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert f"{call.split('(')[0]} (not visible to msrewrite)" in str(refused.value), refused.value


def test_a_classmethod_writes_what_it_sets_on_its_class():
    module = cst.parse_module(helpers(writing=False) + "\n\ndef f(x):\n    return Scaler.bump(x)\n")
    summaries = ModuleSummaries(module)
    (ret,) = summaries.functions["f"].body.body[0].body
    effect = summaries.scope_for(None, "f").effect_of(ret.value)
    written = [cst.Module([]).code_for_node(e) for e in effect.writes]
    assert written == ["Scaler"], written  # `cls.count = ...`: the class object, not x
    assert not effect.unknown and not effect.may_writes


@pytest.mark.slow  # runs the models through verify
@pytest.mark.parametrize("kind", list(KINDS))
def test_verify_agrees(tmp_path, monkeypatch, kind):
    monkeypatch.syspath_prepend(str(tmp_path))
    tag = kind.replace("-", "_")
    pure = write(tmp_path, kind, writing=False, name=f"fw_pure_{tag}")
    step = edit(pure)
    edited = tmp_path / "pure_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=pure, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems
    writing = write(tmp_path, kind, writing=True, name=f"fw_writes_{tag}")
    text, source = forced(writing)
    raced = tmp_path / "writes_ms.py"
    raced.write_text(text)
    result = verify_files(raced, original=writing, schedule_source=source)
    assert not result.ok, f"{kind}: the forced overlap of the writing twin verified clean"
