"""Functions apply refuses for their form.

A generator or async forward may suspend between the fork and the join: the caller runs other
work with the side stream current or its work in flight, and verify cannot see it (it does not
iterate or await the forward); a nested generator of an ordinary forward is not the forward's
own `yield`. A function declaring `global torch` rejects the edit's own use of torch before it.
"""

from __future__ import annotations

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec

MODEL = """import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    DEF forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(x)
        LAST
"""


def steps(tmp_path, text):
    path = tmp_path / "block.py"
    path.write_text(text)
    src = load(path)
    flag = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")
    return case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, flag, None)


@pytest.mark.parametrize(
    ("define", "last", "what"),
    [("def", "yield h + s", "a generator"), ("async def", "return h + s", "an async function")],
)
def test_a_forward_that_may_suspend_is_refused(tmp_path, define, last, what):
    with pytest.raises(NothingToDo, match=f"forward\\(\\) is {what}: it may suspend between the fork and the join"):
        steps(tmp_path, MODEL.replace("DEF", define).replace("LAST", last))


def test_a_nested_generator_is_not_the_forwards_own_yield(tmp_path):
    last = "def pieces():\n            yield h\n\n        return sum(pieces()) + s"
    step = steps(tmp_path, MODEL.replace("DEF", "def").replace("LAST", last))[-1]
    assert step.plans[0].function == "Block.forward"


def test_a_forward_declaring_global_torch_is_refused_before_the_edit_fails_to_compile(tmp_path):
    last = "global torch\n        return h + s"
    with pytest.raises(NothingToDo, match="declares `global`/`nonlocal` torch, a name the edit's own code uses"):
        steps(tmp_path, MODEL.replace("DEF", "def").replace("LAST", last))
