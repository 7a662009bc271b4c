"""A method of a string literal (`"-".join(names)`, `"{}:{}".format(a, b)`) is str's own: it writes
nothing and is not a callee msrewrite cannot see into (serving files' refusals once listed them).
The same method on an object msrewrite cannot see (`self.formatter.format(x)`) still may write
its arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")
MODEL = """import torch
from torch import nn

from formatting import make_formatter


class MoE(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.gate = nn.Linear(d, 4)
        self.experts = nn.Linear(d, d)
        self.shared_experts = nn.Linear(d, d)
        self.names = ["a", "b"]
        self.formatter = make_formatter()

    def forward(self, hidden_states):
        shared = self.shared_experts(hidden_states)
{window}        routed = self.experts(hidden_states) * self.gate(hidden_states).softmax(-1)[..., :1]
        return routed + shared


def make():
    torch.manual_seed(0)
    return MoE().eval(), (torch.randn(2, 16),)
"""
LITERALS = (
    '        label = "-".join(self.names)\n'
    '        tag = "{}:{}".format(label, hidden_states.shape[0]) + f"{label}".upper()\n'
)
UNSEEN = "        tag = self.formatter.format(hidden_states)\n"
FORMATTING = """class _Formatter:
    def format(self, value):
        return str(value.shape)


FORMATTERS = {"shape": _Formatter}


def make_formatter():
    return FORMATTERS["shape"]()  # a table filled at import time: its entries are not followed
"""


def _edit(tmp_path: Path, window: str):
    (tmp_path / "formatting.py").write_text(FORMATTING)
    path = tmp_path / "model.py"
    path.write_text(MODEL.replace("{window}", window))
    src = load(path)
    return path, case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None)[-1]


def test_string_literal_methods_are_seen_into(tmp_path):
    _, step = _edit(tmp_path, LITERALS)
    assert step.plans[0].trust_boundary == ()


def test_the_same_method_on_an_unseen_object_is_still_refused(tmp_path):
    with pytest.raises(NothingToDo) as refused:
        _edit(tmp_path, UNSEEN)
    assert "self.formatter.format" in str(refused.value) and "may write 'hidden_states'" in str(refused.value)


@pytest.mark.slow  # runs the model through verify
def test_the_edit_with_string_methods_verifies(tmp_path):
    path, step = _edit(tmp_path, LITERALS)
    edited = tmp_path / "model_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, inputs=0)
    assert result.ok, result.problems
