"""A store into an object's field writes that object, not the value it is given, and a read
module's classes count as classes whether or not a summary has parsed them yet.

SGLang's `get_moe_runner_backend()` does `moe.runner_backend = MoeRunnerBackend.AUTO` on a flags
object: the main path was refused for "writing the module-level 'MoeRunnerBackend' in place".
Its twin, a helper that writes a module-level tensor in place, is still refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.analyze import packages
from msrewrite.analyze.summaries import ModuleSummaries
from msrewrite.commands.apply import case_steps
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")

FLAGS = """import enum
import types

import torch


class Backend(enum.Enum):
    AUTO = "auto"
    TRITON = "triton"


_FLAGS = types.SimpleNamespace(backend=None)
_SCALE = torch.ones(1)


def get_flags():
    return _FLAGS


def get_backend():
    flags = get_flags()
    if flags.backend is None:
        flags.backend = Backend.AUTO
    return flags.backend


def bump_scale():
    _SCALE.add_(1)
    return _SCALE
"""

MODEL = """import torch
from torch import nn

from backends.flags import get_backend, bump_scale


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)
        backend = HELPER()
        h = self.experts(x)
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""


def _tree(tmp_path: Path, helper: str) -> Path:
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "__init__.py").write_text("")
    (tmp_path / "backends" / "flags.py").write_text(FLAGS)
    path = tmp_path / "model.py"
    path.write_text(MODEL.replace("HELPER", helper))
    return path


def _edit(path: Path):
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, protect="none")[-1]


def test_storing_a_class_into_a_flags_object_writes_no_module_state(tmp_path):
    step = _edit(_tree(tmp_path, "get_backend"))
    assert step.plans[0].trust_boundary == ()


def test_a_helper_writing_a_module_level_tensor_is_still_refused(tmp_path):
    with pytest.raises(NothingToDo) as refused:
        _edit(_tree(tmp_path, "bump_scale"))
    assert "module-level '_SCALE'" in str(refused.value), refused.value


@pytest.mark.slow  # runs the model through verify
def test_the_flags_edit_verifies(tmp_path, monkeypatch):
    path = _tree(tmp_path, "get_backend")
    monkeypatch.syspath_prepend(str(tmp_path))
    step = _edit(path)
    edited = tmp_path / "model_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems


def test_a_read_module_lists_classes_no_summary_has_parsed(tmp_path):
    path = _tree(tmp_path, "get_backend")
    user = ModuleSummaries(load(path).module, path=path)
    found = user.find_function("get_backend")
    assert found is not None
    flags = found[0]
    assert flags.path == (tmp_path / "backends" / "flags.py").resolve()
    assert "Backend" in list(flags.classes) and len(flags.classes) == 1  # parsed or not
    assert packages.index_file(flags.path) is not None
