"""Targets named as the frameworks name them: vllm-ascend keeps its shared expert in a private
attribute (`self._shared_experts(x)`), which is the shared expert all the same (issue 27)."""

from __future__ import annotations

import pytest

from msrewrite.cases.moe_shared_expert import is_shared_expert_call
from msrewrite.commands.apply import case_steps
from msrewrite.emit.schedules import ScheduleSource
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")
MODEL = """import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self._shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        s = self._shared_experts(x)
        h = self.experts(self.gate(x))
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""


@pytest.mark.parametrize(
    "callee, seed",
    [
        ("_shared_experts", True),
        ("__shared_expert", True),
        ("_shared_mlp.down_proj", True),
        ("_shared_experts_scale", False),
        ("shared", False),
    ],
)
def test_a_private_shared_expert_is_the_shared_expert(callee, seed):
    assert is_shared_expert_call(callee) is seed


@pytest.mark.slow  # runs the model through verify
def test_a_private_shared_expert_is_edited_and_verifies(tmp_path):
    path = tmp_path / "private_shared.py"
    path.write_text(MODEL)
    src = load(path)
    step = case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None)[-1]
    assert "s = self._shared_experts(x)" in step.new and "wait_stream" in step.new
    edited = tmp_path / "private_shared_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, schedule_source=ScheduleSource(step.old, step.plans))
    assert result.ok and not result.findings, result.problems
