"""Methods and attributes a subclass inherits from a base in another module, read in the
subclass's context (issue 26, item 2).

- dispatch: the base's `__init__` picks a bound method per platform (`self._forward_method =
  self.dispatch_forward()`, SGLang's CustomOp) and its `forward` calls it; the subclass overrides
  the methods the dispatcher returns. The call runs the subclass's overrides: the union of the
  methods the dispatcher can return, looked up on the subclass.
- stored: the base's `__init__` stores a submodule in `self.proj` and the subclass stores another
  there on some path only: a call of `self.proj` may run either (it took only the subclass's).

Each has a must-see model (what runs writes the side branch's input: the case refuses, and the
forced overlap races under verify) and a must-not-overclaim twin (all of it is pure: the case
edits with nothing left unseen, and the edit verifies clean).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.verify import verify_files
from test_reach import edit, forced

OP = """import torch
from torch import nn

USE_FAST = True


class CustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self._forward_method = self.dispatch_forward()

    def dispatch_forward(self):
        if USE_FAST:
            return self.forward_fast
        return self.forward_native

    def forward(self, *args, **kwargs):
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_fast(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)


class Writing(nn.Module):
    def forward(self, x):
        return x.mul_(2)


class Scaling(nn.Module):
    def forward(self, x):
        return x * 2


class Projected(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = STORED()
"""

MODEL = """import torch
from torch import nn

from fwop.op import CustomOp, Projected


class SiluLike(CustomOp):
    def forward_native(self, x):
        return x * torch.sigmoid(x)

    def forward_fast(self, x):
        return FAST


class Pure(nn.Module):
    def forward(self, x):
        return x + 1


class Routed(Projected):
    def __init__(self, flag=False):
        super().__init__()
        if flag:
            self.proj = Pure()

    def forward(self, x):
        return self.proj(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = ROUTED

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(x)
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""

# kind -> (the routed module Block builds, the pure texts, the writing texts)
KINDS = {
    "dispatch": ("SiluLike()", {"FAST": "x * torch.sigmoid(x) * 2"}, {"FAST": "x.mul_(torch.sigmoid(x))"}),
    "stored": ("Routed()", {"STORED": "Scaling"}, {"STORED": "Writing"}),
}
DEFAULTS = {"FAST": "x * torch.sigmoid(x) * 2", "STORED": "Scaling"}


def write(tmp_path: Path, kind: str, writing: bool, name: str = "fwop") -> Path:
    routed, pure, bad = KINDS[kind]
    fill = {**DEFAULTS, **(bad if writing else pure)}
    package = tmp_path / name
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "op.py").write_text(OP.replace("STORED", fill["STORED"]))
    text = MODEL.replace("FAST", fill["FAST"]).replace("ROUTED", routed).replace("from fwop.", f"from {name}.")
    path = tmp_path / f"{kind}_{'writes' if writing else 'pure'}.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("kind", list(KINDS))
def test_what_the_subclass_runs_is_seen(tmp_path, kind):
    with pytest.raises(NothingToDo) as refused:
        edit(write(tmp_path, kind, writing=True))
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value
    assert "not visible to msrewrite" not in str(refused.value)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_pure_subclass_is_proved_pure(tmp_path, kind):
    step = edit(write(tmp_path, kind, writing=False))
    assert step.plans[0].trust_boundary == ()
    assert step.plans[0].protect_inputs == ()


@pytest.mark.slow  # runs the models through verify
@pytest.mark.parametrize("kind", list(KINDS))
def test_verify_agrees(tmp_path, monkeypatch, kind):
    monkeypatch.syspath_prepend(str(tmp_path))
    pure = write(tmp_path, kind, writing=False, name=f"fwop_pure_{kind}")
    step = edit(pure)
    edited = tmp_path / "pure_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=pure, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems
    writing = write(tmp_path, kind, writing=True, name=f"fwop_writes_{kind}")
    text, source = forced(writing)
    raced = tmp_path / "writes_ms.py"
    raced.write_text(text)
    result = verify_files(raced, original=writing, schedule_source=source)
    assert not result.ok, f"{kind}: the forced overlap of the writing twin verified clean"


def test_a_base_method_naming_its_own_module_is_not_read_again(tmp_path):
    """A base method that uses a name of its own module (a helper there) would mean something
    else read in the subclass's file: it stays unknown, as before."""
    path = write(tmp_path, "dispatch", writing=False)
    op = tmp_path / "fwop" / "op.py"
    op.write_text(
        op.read_text().replace(
            "        return self._forward_method(*args, **kwargs)",
            "        return trace(self._forward_method(*args, **kwargs))",
        )
        + "\n\ndef trace(y):\n    return y\n"
    )
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "CustomOp.forward uses self.forward_fast, which SiluLike overrides" in str(refused.value), refused.value


def test_a_dispatcher_returning_anything_else_is_not_followed(tmp_path):
    path = write(tmp_path, "dispatch", writing=False)
    op = tmp_path / "fwop" / "op.py"
    op.write_text(op.read_text().replace("        return self.forward_native\n", "        return REGISTRY[0]\n"))
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "self._forward_method" in str(refused.value), refused.value


def test_a_base_method_using_the_same_imports_is_read_again(tmp_path):
    """`torch` is the same import in both files: the base's forward means the same in the subclass's."""
    path = write(tmp_path, "dispatch", writing=False)
    op = tmp_path / "fwop" / "op.py"
    op.write_text(
        op.read_text().replace(
            "        return self._forward_method(*args, **kwargs)",
            "        return torch.relu(self._forward_method(*args, **kwargs))",
        )
    )
    assert edit(path).plans[0].trust_boundary == ()
