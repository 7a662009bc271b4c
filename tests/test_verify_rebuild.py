"""verify rebuilds the edited model through the user's make(), not only its constructor.

What make() does after construction (switching a layer to its in-place path, binding a method)
must reach the edited model as it reaches the original: a race that only that set-up enables is
otherwise never run, and verify passes an edit a device would break.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.verify import verify_files
from test_reach import forced  # the shared expert beside the routed call, as `apply --plan` forces it

MODEL = """import torch
from torch import nn


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)
        self.inplace = False  # the serving harness switches it on after construction

    def forward(self, x):
        if self.inplace:
            return x.mul_(2)
        return self.w(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = Experts()
        self.late = None  # bound by bind(), which make() calls

    def bind(self):
        self.late = self.double

    def double(self, x):
        return x * 2

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(x)
        return LATE + s
"""

MAKE = """

def make():
    torch.manual_seed(0)
    block = Block()
    block.bind()
    block.experts.inplace = INPLACE
    return block, (torch.randn(2, 8, 16),)
"""

HARNESS = """import torch

from MODULE import Block


def make():
    torch.manual_seed(0)
    block = Block()
    block.bind()
    block.experts.inplace = INPLACE
    return block, (torch.randn(2, 8, 16),)
"""


def verify_forced(tmp_path: Path, inplace: bool, harness_file: bool):
    """The forced overlap verified; `inplace`: make() switches the routed experts to their in-place
    path (a race), else make()'s bind() is what the forward needs (no race)."""
    late = "h" if inplace else "self.late(h)"
    model = MODEL.replace("LATE", late)
    folder = tmp_path / ("external" if harness_file else "inline")
    folder.mkdir()
    stem = f"block_{'inplace' if inplace else 'bound'}_{'external' if harness_file else 'inline'}"  # one per test
    original = folder / f"{stem}.py"
    original.write_text(model if harness_file else model + MAKE.replace("INPLACE", str(inplace)))
    harness = None
    if harness_file:
        (folder / "serving_harness.py").write_text(HARNESS.replace("INPLACE", str(inplace)).replace("MODULE", stem))
        harness = f"{folder / 'serving_harness.py'}:make"
    text, source = forced(original)
    edited = folder / f"{stem}_ms.py"
    edited.write_text(text)
    return verify_files(edited, original=original, harness=harness, schedule_source=source)


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize("harness_file", [False, True], ids=["make-in-file", "harness-file"])
def test_a_race_enabled_by_set_up_in_make_is_caught(tmp_path, harness_file):
    result = verify_forced(tmp_path, inplace=True, harness_file=harness_file)
    assert not result.ok, "the in-place path make() switches on was never run on the edited model"
    # the race itself, not a difference in how the two files were set up
    assert any(finding.kind.startswith("race") for finding in result.findings), result.problems
    assert not any(problem.startswith("flag off") for problem in result.problems), result.problems


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize("harness_file", [False, True], ids=["make-in-file", "harness-file"])
def test_set_up_in_make_reaches_the_edited_model(tmp_path, harness_file):
    # bind() runs only in make(): rebuilt by the constructor alone, the edited model calls None
    result = verify_forced(tmp_path, inplace=False, harness_file=harness_file)
    assert result.ok and not result.findings, result.problems
