"""A side call inside an `if` that leaves the function before the rest of the side work (issue 10).

SGLang's kimi_k3.py `_forward_shared_experts` starts with `if not tp_comm: return
self.shared_experts(h)` and runs the shared expert again after it. Such an `if` stays where it
is, its side call on the main stream as before; the fork comes after it, so the path that
returns there never forks, and the path that falls through has run it exactly as the original
did: the edit verifies (the path that falls through), and the path that returns early computes
the same with the flag on and off, on the main stream only. A returning `if` after
the side work has started is refused naming its return line: that path would leave unjoined.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.harness import load_module
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.runtime import install
from msrewrite.verify import verify_files

FLAG = "ENABLE_MOE_SHARED_EXPERT_STREAM"

PRELUDE = """\
import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d=16, tp_comm=True):
        super().__init__()
        self.tp_comm = tp_comm
        self.gate = nn.Linear(d, 4, bias=False)
        self.experts = MLP(d)
        self.shared_experts = MLP(d)
        self.gather = MLP(d)

    def forward(self, x):
"""

MAKE = """

def make():
    torch.manual_seed(0)
    return Block(tp_comm=TP_COMM).eval(), (torch.randn(8, 16),)
"""

EARLY_RETURN_THEN_OVERLAP = """
if not self.tp_comm:
    return self.shared_experts(x)
shared = self.shared_experts(x)
weights = self.gate(x).softmax(dim=-1)
out = self.experts(x) * weights[:, :1]
return out + shared
"""

# the kimi_k3 shape reduced: on the path that falls through, the side input comes from the
# main path and its result is consumed at once
EARLY_RETURN_NOTHING_BETWEEN = """
if not self.tp_comm:
    return self.shared_experts(x)
gathered = self.gather(x)
shared = self.shared_experts(gathered)
return shared + gathered
"""

SIDE_WORK_BEFORE_THE_RETURN = """
shared = self.shared_experts(x)
if not self.tp_comm:
    return shared + self.shared_experts(x)
out = self.experts(x)
return out + shared
"""


def model(folder: Path, forward: str, tp_comm: bool = True, name: str = "block") -> Path:
    path = folder / f"{name}.py"
    body = textwrap.indent(textwrap.dedent(forward).strip("\n"), " " * 8)
    path.write_text(PRELUDE + body + "\n" + MAKE.replace("TP_COMM", str(tp_comm)))
    return path


def edit(path: Path) -> tuple[Path, str]:
    src = load(path)
    steps = case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FlagSpec(name=FLAG), None)
    edited = path.with_name(f"{path.stem}_ms.py")
    edited.write_text(steps[-1].new)
    return edited, steps[-1].new


@pytest.mark.slow  # runs the model through verify
def test_an_early_returning_if_stays_and_the_rest_is_edited(tmp_path):
    original = model(tmp_path, EARLY_RETURN_THEN_OVERLAP)
    edited, text = edit(original)
    early = "        if not self.tp_comm:\n            return self.shared_experts(x)\n"
    assert early in text and text.index(early) < text.index("wait_stream")  # untouched, before the fork
    result = verify_files(edited, original=original)
    assert result.ok, result.problems
    on = result.runs[2]
    assert on.name == "flag on" and any(stream != "main" for stream in on.streams), on.streams


@pytest.mark.parametrize("flag", ["1", "0"])
def test_the_path_that_returns_early_never_forks_and_computes_the_same(tmp_path, flag):
    """verify runs make(), whose block falls through; here the block takes the early return."""
    original = model(tmp_path, EARLY_RETURN_THEN_OVERLAP, tp_comm=False)
    edited, _ = edit(original)
    block, (x,) = load_module(original, name=f"early_exit_original_{flag}").make()
    expected = block(x)
    os.environ[FLAG] = flag
    try:
        with install() as rt, rt.record_ops() as ops:
            block, (x,) = load_module(edited, name=f"early_exit_edited_{flag}").make()
            out = block(x)
    finally:
        del os.environ[FLAG]
    assert torch.equal(out, expected)
    assert ops and {op.stream for op in ops} == {"main"}  # nothing was issued on a side stream


def test_the_kimi_shape_has_nothing_to_overlap(tmp_path):
    with pytest.raises(NothingToDo, match="no main-path work between the fork and the join: nothing to overlap"):
        edit(model(tmp_path, EARLY_RETURN_NOTHING_BETWEEN))


def test_a_return_after_the_side_work_started_is_refused_naming_its_line(tmp_path):
    path = model(tmp_path, SIDE_WORK_BEFORE_THE_RETURN)
    lines = path.read_text().splitlines()
    at = {text.strip(): n for n, text in enumerate(lines, 1)}
    with pytest.raises(NothingToDo) as err:
        edit(path)
    why = str(err.value)
    assert (
        f"line {at['if not self.tp_comm:']}: the side-branch call sits inside `if not self.tp_comm`, which returns "
        f"from the function at line {at['return shared + self.shared_experts(x)']} after the side work at line "
        f"{at['shared = self.shared_experts(x)']} has started: that path would leave without joining the side "
        "stream"
    ) in why, why
