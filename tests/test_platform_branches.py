"""Code under another platform's test is not read for an edit that cannot run there.

Serving layers keep every platform's path in one function (`if _is_npu: torch_npu.npu_x(...)`,
`if _is_cpu: ...`). A CUDA edit never runs the NPU branch, so what that branch may write is no
hazard of it, and the other way round; the trust boundary says which tests were taken so. Only
a module-level name bound once to a platform helper and never bound again counts
(analyze/platforms.py); anything else keeps every branch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.analyze.packages import module_platform_names
from msrewrite.commands.apply import case_steps
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")

MODEL = """import torch
from torch import nn


def is_npu():
    return False


def is_cpu():
    return False


_is_npu = is_npu()
_is_cpu = is_cpu()
REBIND


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)

    def forward(self, x):
        if TEST:
            x.mul_(2)  # a fused in-place kernel of that platform
        return self.w(x)


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


def write(tmp_path: Path, test: str, rebind: str = "") -> Path:
    path = tmp_path / "platform_block.py"
    path.write_text(MODEL.replace("TEST", test).replace("REBIND", rebind))
    return path


def edit(path: Path, mode: str):
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", mode, None, FLAG, None, protect="none")[-1]


@pytest.mark.parametrize(
    ("test", "mode"),
    [("_is_npu", "cuda"), ("_is_cpu", "cuda"), ("_is_cpu and x.is_contiguous()", "cuda"), ("_is_cpu", "eager")],
)
def test_another_platforms_write_is_no_hazard(tmp_path, test, mode):
    step = edit(write(tmp_path, test), mode)
    (boundary,) = [line for line in step.plans[0].trust_boundary if "platform" in line]
    assert f"`if {test}:`" in boundary and mode in boundary


# a module-level name bound once to `<anything> and <platform test>` (SGLang's `_use_aiter =
# get_bool_env_var("SGLANG_USE_AITER") and _is_hip`) is true only on that platform
DERIVED = "_use_other = bool(len('on')) and _is_npu"


@pytest.mark.parametrize(("test", "mode"), [("_use_other", "cuda"), ("_use_other and x.is_contiguous()", "cuda")])
def test_a_name_implying_another_platform_hides_its_write(tmp_path, test, mode):
    step = edit(write(tmp_path, test, DERIVED), mode)
    (boundary,) = [line for line in step.plans[0].trust_boundary if "platform" in line]
    assert f"`if {test}:`" in boundary and mode in boundary


@pytest.mark.parametrize(
    ("test", "mode", "rebind"),
    [
        ("_is_npu", "eager", ""),  # the NPU branch runs for an NPU edit
        ("not _is_npu", "cuda", ""),  # ... and `not` of another platform runs on this one
        ("_is_npu or x.is_contiguous()", "cuda", ""),
        ("_is_npu", "cuda", "_is_npu = True"),  # bound twice: no longer the helper's answer
        ("_is_npu", "cuda", "def flip(_is_npu=True):\n    return _is_npu"),  # a parameter of that name
        ("_is_npu", "cuda", "def reset():\n    global _is_npu\n    _is_npu = True"),
        # `X and <npu test>` may be false on NPU: its `not` runs there
        ("not (_is_npu and x.is_contiguous())", "eager", ""),
        ("not _use_other", "eager", DERIVED),
        ("_use_other", "eager", DERIVED),  # true on NPU (when X is)
        ("_use_other", "cuda", DERIVED + "\n_use_other = True"),  # bound twice
    ],
)
def test_this_platforms_write_is_still_seen(tmp_path, test, mode, rebind):
    with pytest.raises(NothingToDo) as refused:
        edit(write(tmp_path, test, rebind), mode)
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value


def test_only_a_name_bound_once_to_a_helper_counts():
    text = "from u import is_npu, is_cuda\n_is_npu = is_npu()\n_is_cuda = is_cuda()\n_b = is_npu(0)\n"
    assert module_platform_names(text) == {"_is_npu": "npu", "_is_cuda": "cuda"}
    assert module_platform_names(text + "for _is_cuda in (1,):\n    pass\n") == {"_is_npu": "npu"}
    assert module_platform_names(text + "import os as _is_npu\n") == {"_is_cuda": "cuda"}
    assert module_platform_names("def f(:\n") == {}


def test_a_name_bound_to_and_with_a_test_only_implies_its_platform():
    text = "from u import is_hip, env\n_is_hip = is_hip()\n_use_aiter = env('A') and _is_hip\n"
    text += (
        "_gfx = _is_hip and env('B')\n_deep = env('C') and (env('D') and _use_aiter)\n_either = env('E') or _is_hip\n"
    )
    found = module_platform_names(text)
    assert found == {"_is_hip": "cuda", "_use_aiter": "cuda?", "_gfx": "cuda?", "_deep": "cuda?"}
    assert "_use_aiter" not in module_platform_names(text + "_use_aiter = True\n")
    assert module_platform_names(text + "_is_hip = False\n") == {}  # the test itself bound twice


def test_an_else_after_an_implied_npu_test_runs_on_npu(tmp_path):
    path = write(tmp_path, "_is_npu and x.is_contiguous()")
    path.write_text(path.read_text().replace("x.mul_(2)  #", "pass\n        else:\n            x.mul_(2)  #"))
    with pytest.raises(NothingToDo) as refused:
        edit(path, "eager")
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize(("test", "rebind"), [("_is_npu", ""), ("_use_other", DERIVED)])
def test_verify_agrees(tmp_path, test, rebind):
    path = write(tmp_path, test, rebind)
    step = edit(path, "cuda")
    edited = tmp_path / "platform_block_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems
