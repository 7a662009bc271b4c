"""A guard written over several lines (issue 27 item 9): `if (a\\n and b):`, a comment inside it, a
backslash continuation. The guard is emitted in a comment and in the fork's one-line `if`, so it is
carried on one line; the original `if` keeps its own spelling. It used to raise
`ValueError: guard must be one line of printable text` with a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_main
from msrewrite.commands.apply import case_steps
from msrewrite.load import load
from msrewrite.plan import FlagSpec

MODEL = """\
import torch
from torch import nn


class MoeBlock(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.experts = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden, hidden)
        self.shared_experts = nn.Linear(hidden, hidden)
        self.use_shared = True

    def forward(self, x):
        shared = None
        if CONDITION:
            shared = self.shared_experts(x)
            h = self.gate(x)
            routed = self.experts(h) + shared
        else:
            routed = self.experts(x)
        return routed


def make():
    torch.manual_seed(0)
    return MoeBlock(), (torch.randn(4, 16),)
"""

CONDITIONS = {
    "parenthesized": ("(self.use_shared\n                and x.shape[0] > 0)", "(self.use_shared and x.shape[0] > 0)"),
    "comment-inside": (
        "(self.use_shared  # configured\n                and x.shape[0] > 0)",
        "(self.use_shared and x.shape[0] > 0)",
    ),
    "backslash": ("self.use_shared and \\\n                x.shape[0] > 0", "self.use_shared and x.shape[0] > 0"),
    "tuple": (
        "x.shape[0] > 0 and self.use_shared in (True,\n                1)",
        "x.shape[0] > 0 and self.use_shared in (True, 1)",
    ),
}


def model(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "block.py"
    path.write_text(MODEL.replace("CONDITION", CONDITIONS[name][0]))
    return path


def steps_of(path: Path):
    src = load(path)
    return case_steps(
        path,
        src.text,
        src.module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )


@pytest.mark.parametrize("name", sorted(CONDITIONS))
def test_a_multi_line_guard_is_carried_on_one_line(tmp_path, name):
    path = model(tmp_path, name)
    (step,) = steps_of(path)
    written, one_line = CONDITIONS[name]
    (plan,) = step.plans
    assert plan.guard == one_line
    fork = one_line if one_line.startswith("(") else f"({one_line})"  # `and` would split it otherwise
    assert f"if shared_expert_stream is not None and {fork}:" in step.new
    assert f"# Only when {one_line}, as in the `if` below" in step.new
    assert f"if {written}:" in step.new  # the original `if`, as written, now holds the join
    compile(step.new, str(path), "exec")


def test_apply_plan_carries_the_one_line_guard(tmp_path):
    path = model(tmp_path, "parenthesized")
    (step,) = steps_of(path)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps([p.to_dict() for p in step.plans]))
    result = run_main("apply", "--plan", str(plan_file), str(path))
    assert result.returncode == 0, result.stderr
    assert "+        if shared_expert_stream is not None and (self.use_shared and x.shape[0] > 0):" in result.stdout


@pytest.mark.slow  # the CLI with verify
@pytest.mark.parametrize("name", ["parenthesized", "backslash"])
def test_a_multi_line_guard_edit_verifies(tmp_path, name):
    path = model(tmp_path, name)
    result = run_main("apply", "--case", "moe-shared-expert", str(path), "--verify")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
