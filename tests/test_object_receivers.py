"""A method called on a local that may hold an object is that object's method.

`acc = get_acc(); acc.add(x, h)` reads like `Tensor.add`, which writes nothing, but `acc` is
whatever `get_acc()` returned: its `add` may write x. The analysis must not pick the tensor
method by name: a local bound to `self.<attr>` is read as that attribute's method (seen into when
its class is in the file), one bound to a call no torch table knows is unknown and named. Locals
bound to tensors (`h = self.gate(x)`, `v = self.scale.view(-1)`) keep the tensor tables.
tests/adversarial/local_{object,attribute}_method.py run the unsafe twins through verify.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")

MODEL = """import torch
from torch import nn


class Acc:
    def add(self, x, y):
        BODY


def get_acc():
    return Acc()


def get_pair():
    return Acc(), None


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.gate = nn.Linear(16, 16)
        self.acc = Acc()

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.gate(x)
        BIND
        h = acc.add(x, h)
        return h + s
"""
WRITES = "x.mul_(2).add_(y)\n        return x"
PURE = "return x * 2 + y"


def edit(tmp_path: Path, bind: str, body: str, protect: str = "none"):
    path = tmp_path / "block.py"
    path.write_text(MODEL.replace("BIND", bind).replace("BODY", body))
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, protect=protect)[-1]


def test_a_local_from_a_call_is_an_object_whose_method_is_unknown_and_named(tmp_path):
    with pytest.raises(NothingToDo) as refused:
        edit(tmp_path, "acc = get_acc()", PURE)
    why = str(refused.value)
    assert "acc.add (not visible to msrewrite)" in why, why
    assert "may write 'x'" in why, why
    assert edit(tmp_path, "acc = get_acc()", PURE, protect="auto").plans[0].protect_inputs == ("x",)


def test_a_local_bound_to_an_attribute_is_read_as_the_attributes_method(tmp_path):
    with pytest.raises(NothingToDo) as refused:
        edit(tmp_path, "acc = self.acc", WRITES)
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), refused.value
    step = edit(tmp_path, "acc = self.acc", PURE)  # Acc.add seen into: pure, no snapshot, no boundary
    assert step.plans[0].protect_inputs == () and step.plans[0].trust_boundary == ()


def test_each_part_of_an_unpacked_call_is_an_object(tmp_path):
    with pytest.raises(NothingToDo) as refused:
        edit(tmp_path, "acc, _unused = get_pair()", PURE)
    assert "acc.add (not visible to msrewrite)" in str(refused.value), refused.value


def test_a_rebinding_through_its_own_method_ends(tmp_path):
    """`acc = acc.lookup()` names itself in its own binding: read once, no endless substitution."""
    bind = "acc = get_acc()\n        acc = acc.lookup()\n        acc = acc.lookup().inner"
    with pytest.raises(NothingToDo) as refused:
        edit(tmp_path, bind, PURE)
    assert "may write 'x'" in str(refused.value), refused.value


def test_tensor_locals_keep_the_tensor_tables(tmp_path):
    text = MODEL.replace(
        "BIND\n        h = acc.add(x, h)", "w = torch.ones(16)\n        h = h.add(x).view(2, 8, 16).mul(w)"
    )
    path = tmp_path / "block.py"
    path.write_text(text.replace("BODY", PURE))
    src = load(path)
    step = case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, protect="none")[-1]
    assert step.plans[0].protect_inputs == () and step.plans[0].trust_boundary == ()
