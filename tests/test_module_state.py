"""Module state (`self.<attr>` tensors) around a side branch.

A tensor method on module state (`self.scale.float()`, `self.bias.view(-1)`) takes its effect from
the tensor-method table, with the state as its receiver: it is not stream code (it once read as
msrewrite's own `_ms_` helpers, which kept a side-only `if` from moving whole), and what it returns
aliases the state. Module state one side of the fork writes and the other reads or writes (by
name, through a view, or inside one of the class's methods) is refused: on a device the side
stream may run before or after the write. Each refusal has an edited twin that verifies clean,
and verify catches the refused race when it is forced."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from msrewrite.analyze.summaries import ModuleSummaries
from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")

MODEL = """import torch
from torch import nn


class MoE(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.gate = nn.Linear(d, 4)
        self.experts = nn.Linear(d, d)
        self.shared_experts = nn.Linear(d, d)
        self.dense_mlp = nn.Linear(d, d)
        self.use_shared = False
        self.scale = nn.Parameter(torch.full((d,), 0.5))

    def forward(self, hidden_states):
        if self.use_shared:
            shared = self.shared_experts(hidden_states)
        else:
{else_branch}
        logits = self.gate(hidden_states)
        routed = self.experts(hidden_states) * logits.softmax(-1)[..., :1] * self.scale
        return routed + shared


def make():
    torch.manual_seed(0)
    return MoE().eval(), (torch.randn(2, 16),)
"""
# the `else` reads module state: the whole `if` is side work and moves
SAFE = "            shared = self.dense_mlp(hidden_states) * self.scale.float()\n"


def _edit(tmp_path: Path, name: str, text: str):
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    src = load(path)
    step = case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None)[-1]
    return path, step


def _refusal(tmp_path: Path, name: str, text: str) -> str:
    """Why moe-shared-expert refuses the model `text` (the test fails if it edits it)."""
    with pytest.raises(NothingToDo) as refused:
        _edit(tmp_path, name.replace("-", "_"), text)
    return str(refused.value)


def test_a_tensor_method_on_module_state_is_not_stream_code():
    module = cst.parse_module(MODEL.replace("{else_branch}\n", SAFE))
    scope = ModuleSummaries(module).scope_for("MoE", "forward")
    effect = scope.effect_of(cst.parse_expression("self.scale.float()"))
    assert not effect.stream and not effect.unknown and not effect.writes
    view = scope.effect_of(cst.parse_expression("self.scale.view(-1)"))
    assert [cst.Module(body=[]).code_for_node(r) for r in view.returns] == ["self.scale"]


def test_the_whole_if_moves_when_its_else_only_reads_module_state(tmp_path):
    _, step = _edit(tmp_path, "safe", MODEL.replace("{else_branch}\n", SAFE))
    assert step.plans[0].side_lines == [[16, 19]], step.plans[0].side_lines


@pytest.mark.slow  # runs the model through verify
def test_the_whole_if_edit_verifies_clean(tmp_path):
    path, step = _edit(tmp_path, "safe", MODEL.replace("{else_branch}\n", SAFE))
    edited = tmp_path / "safe_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, inputs=0)
    assert result.ok, result.problems


# Module state between the fork and the join: the side work reads `self.<attr>` by name, not
# through an input, so a main-path write to it is checked by attribute.
STATE = """import torch
from torch import nn


class MoE(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.experts = nn.Linear(d, d)
        self.shared_experts = nn.Linear(d, d)
        self.scale = nn.Buffer(torch.full((d,), 0.5))
        self.calls = nn.Buffer(torch.zeros(()))

    def _routed(self, hidden_states):
        return self.experts(hidden_states) * self.scale

    def forward(self, hidden_states):
{body}        return routed + shared

    def _handed(self, hidden_states):
        return scaled(self, hidden_states)


def scaled(module, hidden_states):
    return hidden_states * module.scale


def make():
    torch.manual_seed(0)
    return MoE().eval(), (torch.randn(2, 16),)
"""
# name -> (forward body up to the return, what the refusal says)
STATE_REFUSED = {
    "main-writes-what-the-side-reads": (
        "        shared = self.shared_experts(hidden_states) * self.scale\n"
        "        routed = self.experts(hidden_states)\n"
        "        self.scale.mul_(1.5)\n",
        "line 19 writes module state 'self.scale' while the side stream reads it",
    ),
    "main-writes-it-through-a-view": (
        "        shared = self.shared_experts(hidden_states) * self.scale\n"
        "        routed = self.experts(hidden_states)\n"
        "        view = self.scale.view(-1)\n"
        "        view.mul_(1.5)\n",
        "line 20 writes module state 'self.scale' (through 'view') while the side stream reads it",
    ),
    "side-writes-what-the-main-path-reads": (
        "        shared = self.shared_experts(hidden_states) * self.scale.mul_(1.0)\n"
        "        routed = self.experts(hidden_states) * self.scale\n",
        "the side branch writes module state 'self.scale'",
    ),
    # what a method of the class reads is what its body names (self._routed reads self.scale)
    "main-writes-what-a-side-method-reads": (
        "        shared = self.shared_experts(hidden_states) + self._routed(hidden_states)\n"
        "        routed = self.experts(hidden_states)\n"
        "        self.scale.mul_(1.5)\n",
        "line 19 writes module state 'self.scale' while the side stream reads it",
    ),
    # a method that hands `self` on may read any of it
    "main-writes-what-a-side-method-may-read": (
        "        shared = self.shared_experts(hidden_states) + self._handed(hidden_states)\n"
        "        routed = self.experts(hidden_states)\n"
        "        self.scale.mul_(1.5)\n",
        "line 19 writes module state 'self.scale' while the side stream reads 'self'",
    ),
}
# the main path writes state the side work never reads: edited
STATE_EDITED = (
    "        shared = self.shared_experts(hidden_states) * self.scale\n"
    "        routed = self.experts(hidden_states)\n"
    "        self.calls.add_(1)\n"
)


@pytest.mark.parametrize("name", list(STATE_REFUSED))
def test_module_state_written_on_one_side_and_used_on_the_other_is_refused(tmp_path, name):
    body, reason = STATE_REFUSED[name]
    why = _refusal(tmp_path, name, STATE.replace("{body}", body))
    assert reason in why, why


def test_module_state_the_side_never_reads_may_be_written(tmp_path):
    _, step = _edit(tmp_path, "other_state", STATE.replace("{body}", STATE_EDITED))
    assert step.plans[0].side_lines == [[17, 17]]


@pytest.mark.slow  # runs the model through verify
def test_verify_agrees_on_both(tmp_path):
    """The edit verifies clean; the same edit with the main path writing the state the side
    reads is the race the analysis refuses, and verify reports it."""
    path, step = _edit(tmp_path, "other_state", STATE.replace("{body}", STATE_EDITED))
    edited = tmp_path / "other_state_ms.py"
    edited.write_text(step.new)
    assert verify_files(edited, original=path, inputs=0).ok
    racy = tmp_path / "racy.py"
    racy.write_text(path.read_text().replace("self.calls.add_(1)", "self.scale.mul_(1.5)"))
    racy_edit = tmp_path / "racy_ms.py"
    racy_edit.write_text(step.new.replace("self.calls.add_(1)", "self.scale.mul_(1.5)"))
    result = verify_files(racy_edit, original=racy, inputs=0)
    assert not result.ok
    assert any("race" in p for p in result.problems), result.problems


# State written inside a callee: a submodule's forward writing its own buffer, a module-level
# tensor. The callee's summary carries them (Summary.state_writes), so the call writes its
# receiver (`self.shared_experts`) or the module-level name.
CALLEE_STATE = """import torch
from torch import nn

_SCALE = torch.ones(16)


class Shared(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.calls = 0
        self.last = nn.Buffer(torch.zeros(d))

    def forward(self, x):
        self.calls += 1  # a Python number on the host: not device state
        y = self.lin(x) * _SCALE
        self.last.copy_(y[0])
        return y


class MoE(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.experts = nn.Linear(d, d)
        self.shared_experts = Shared(d)

    def forward(self, hidden_states):
        shared = self.shared_experts(hidden_states)
{window}        routed = self.experts(hidden_states)
        return routed + shared


def make():
    torch.manual_seed(0)
    return MoE().eval(), (torch.randn(2, 16),)
"""
CALLEE_REFUSED = {
    "main-reads-what-the-side-submodule-writes": (
        "        hidden_states = hidden_states + self.shared_experts.last\n",
        "line 28: the side branch writes module state 'self.shared_experts', which the main path reads between "
        "the fork and the join (line 29: 'self.shared_experts')",
    ),
    "main-writes-a-module-level-tensor-the-side-callee-reads": (
        "        _SCALE.mul_(2.0)\n",
        "line 29: the main path writes the module-level '_SCALE' in place between the fork and the join; the side "
        "work may read it",
    ),
}
# the main path neither reads the side submodule's state nor writes a module-level name
CALLEE_EDITED = "        hidden_states = hidden_states * 2.0\n"


@pytest.mark.parametrize("name", list(CALLEE_REFUSED))
def test_state_written_inside_a_callee_is_seen(tmp_path, name):
    window, reason = CALLEE_REFUSED[name]
    why = _refusal(tmp_path, name, CALLEE_STATE.replace("{window}", window))
    assert reason in why, why


@pytest.mark.slow  # runs the model through verify
def test_callee_state_edit_verifies_and_the_refused_race_does_not(tmp_path):
    path, step = _edit(tmp_path, "callee_ok", CALLEE_STATE.replace("{window}", CALLEE_EDITED))
    assert step.plans[0].side_lines == [[28, 28]]
    edited = tmp_path / "callee_ok_ms.py"
    edited.write_text(step.new)
    assert verify_files(edited, original=path, inputs=0).ok
    for racy_line in (
        "        _SCALE.mul_(2.0)\n",
        "        hidden_states = hidden_states + self.shared_experts.last\n",
    ):
        racy = tmp_path / "racy.py"
        racy.write_text(path.read_text().replace(CALLEE_EDITED, racy_line))
        racy_edit = tmp_path / "racy_ms.py"
        racy_edit.write_text(step.new.replace(CALLEE_EDITED, racy_line))
        result = verify_files(racy_edit, original=racy, inputs=0)
        assert not result.ok and any("race" in p for p in result.problems), (racy_line, result.problems)


# Through a local alias only what the alias was bound from counts as the callee's state: an
# attribute of self, not a local an unseen call or a method may have returned, nor a dict of results.
ALIASED = CALLEE_STATE.replace(
    "        self.last.copy_(y[0])\n",
    "{write}",
)
ALIAS_OF_STATE = "        buf = self.last\n        buf.copy_(y[0])\n"
NOT_STATE = (
    "        parts = {}\n"
    "        parts['scale'] = self.scale_of(y)\n"
    "        parts['scale'].mul_(1.0)\n"
    "        y = y * parts['scale']\n"
)
SCALE_OF = "    def scale_of(self, y):\n        return y.abs().mean()\n\n    def forward(self, x):\n"


def test_a_write_through_an_alias_of_the_callees_state_counts(tmp_path):
    source = ALIASED.replace("{write}", ALIAS_OF_STATE).replace(
        "{window}", CALLEE_REFUSED["main-reads-what-the-side-submodule-writes"][0]
    )
    with pytest.raises(NothingToDo, match="the side branch writes module state 'self.shared_experts'"):
        _edit(tmp_path, "alias_of_state", source)


@pytest.mark.slow  # runs the model through verify
def test_a_dict_of_method_results_is_not_the_callees_state(tmp_path):
    source = ALIASED.replace("{write}", NOT_STATE).replace("    def forward(self, x):\n", SCALE_OF, 1)
    source = source.replace("{window}", CALLEE_REFUSED["main-reads-what-the-side-submodule-writes"][0])
    path, step = _edit(tmp_path, "not_state", source)
    edited = tmp_path / "not_state_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, inputs=0)
    assert result.ok, result.problems


# A callee that writes an argument handed `None` (or another builtin) writes no module-level
# name; handed a module-level tensor, it does.
FILL = CALLEE_STATE.replace(
    "class MoE(nn.Module):",
    "def fill(t, out):\n    if out is not None:\n        out.copy_(t[0])\n    return t\n\n\nclass MoE(nn.Module):",
)


def test_a_module_level_tensor_handed_to_a_writing_callee_is_refused(tmp_path):
    source = FILL.replace("{window}", "        hidden_states = fill(hidden_states * 2.0, _SCALE)\n")
    with pytest.raises(NothingToDo, match="writes the module-level '_SCALE' in place"):
        _edit(tmp_path, "fill_global", source)


@pytest.mark.slow  # runs the model through verify
def test_none_handed_to_a_writing_callee_is_no_module_level_write(tmp_path):
    path, step = _edit(
        tmp_path, "fill_none", FILL.replace("{window}", "        hidden_states = fill(hidden_states * 2.0, None)\n")
    )
    edited = tmp_path / "fill_none_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, inputs=0)
    assert result.ok, result.problems


def test_a_method_reads_what_its_body_names_or_all_of_the_object_when_self_escapes():
    import libcst as cst

    from msrewrite.analyze.summaries import ModuleSummaries

    module = cst.parse_module(STATE.replace("{body}", "        routed = shared = hidden_states\n"))
    reads = ModuleSummaries(module).scope_for("MoE", "forward").method_reads
    assert reads is not None
    assert reads("_routed") == {"self.experts", "self.scale"}
    assert reads("_handed") is None  # `self` handed to scaled(): any of its state
    assert reads("missing") is None  # not defined here: inherited from a class msrewrite may not see
    # a method of a submodule reads that submodule's state, whatever it names
    module = cst.parse_module(
        STATE.replace("{body}", "        routed = shared = hidden_states\n").replace(
            "return scaled(self, hidden_states)", "return self.shared_experts.reset_parameters()"
        )
    )
    handed = ModuleSummaries(module).scope_for("MoE", "forward").method_reads
    assert handed is not None and "self.shared_experts" in (handed("_handed") or set())
