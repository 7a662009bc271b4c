"""Refusals a reviewer can act on in one run (issue 26, item 5).

A function can be blocked by several things the analysis meets one after the other: an unseen
callee on the side branch, then one on the main path handed module state the side uses. Each used
to be named in its own run: the user passed `--assume-pure X` and the next run named the next.
Now the finder lifts each refusal that `--assume-pure` (or `--protect clone`) lifts and analyses
the function again, so one refusal names every blocker, says "may write" where a callee is only
unseen and why it is unseen, and ends with the command line that edits (checked by making the
edit). Also here: `h *= self.scale` writes h, not the scale it reads.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import libcst as cst
import pytest

from helpers import ROOT, main_in_process, run_main
from msrewrite.analyze.defuse import node_facts
from msrewrite.analyze.summaries import Storage
from msrewrite.cases._finder import _blockers

ADVERSARIAL = ROOT / "tests" / "adversarial"

OPAQUE = """\
import torch
from torch import nn


def _opaque(name, scale):
    # built at run time: msrewrite cannot read its source (like a kernel library's layer)
    def forward(self, x):
        return x * scale

    return type(name, (nn.Module,), {"forward": forward})


def _opaque_function():
    def scale_rows(weight, y):  # reads the weight, writes nothing
        return y * weight.sum()

    return scale_rows


SideAct = _opaque("SideAct", 3.0)
Prep = _opaque("Prep", 1.0)
scale_rows = _opaque_function()
"""

TWO_ROUNDS = (
    OPAQUE
    + '''

class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.act = SideAct()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.proj(self.act(x))


class Block(nn.Module):
    """The side work's SideAct may write x, which the main path reads (round one); then the
    main path hands the shared expert's weight to scale_rows, which may write it (round two)."""

    def __init__(self, d=16):
        super().__init__()
        self.shared_experts = MLP(d)
        self.experts = nn.Linear(d, d, bias=False)

    def forward(self, x):
        shared = self.shared_experts(x)
        y = self.experts(x)
        y = scale_rows(self.shared_experts.proj.weight, y)
        return y + shared


def make():
    torch.manual_seed(0)
    return Block().eval(), (torch.randn(8, 16),)
'''
)

FORK_WAITS = (
    OPAQUE
    + '''

class Block(nn.Module):
    """The fork waits for self.prep, which msrewrite cannot see into: it only may write x."""

    def __init__(self, d=16):
        super().__init__()
        self.shared_experts = nn.Linear(d, d, bias=False)
        self.experts = nn.Linear(d, d, bias=False)
        self.prep = Prep()

    def forward(self, x):
        y = self.experts(x)
        self.prep(x)
        shared = self.shared_experts(x)
        return y + shared


def make():
    torch.manual_seed(0)
    return Block().eval(), (torch.randn(8, 16),)
'''
)

NO_SOURCE = """\
import torch
from torch import nn
from nowhere_pkg.layers import FusedMoE, Router


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.gate = Router(config)
        self.experts = FusedMoE(config)

    def forward(self, x):
        s = self.shared_experts(x)
        logits = self.gate(x)
        h = self.experts(x, logits)
        return h + s
"""


def write(tmp_path: Path, text: str, name: str = "block.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refused(path: Path, *options: str) -> str:
    """apply's one error line for the file (in this process: no model runs)."""
    result = main_in_process("apply", "--case", "moe-shared-expert", str(path), *options)
    assert result.returncode == 1 and not result.stdout, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("msrewrite: error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def suggested(error: str) -> list[str]:
    """The arguments of the command the refusal ends with."""
    command = error.split("; this command edits: ", 1)[1]
    words = shlex.split(command)
    assert words[0] == "msrewrite", command
    return words[1:]


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), start=1) if line.strip() == text)


# Every blocker in one refusal ------------------------------------------------------------


def test_one_refusal_names_the_blockers_of_both_rounds_and_the_command(tmp_path):
    path = write(tmp_path, TWO_ROUNDS)
    error = refused(path)
    side = line_of(path, "shared = self.shared_experts(x)")
    state = line_of(path, "y = scale_rows(self.shared_experts.proj.weight, y)")
    assert f"line {side}: self.shared_experts (MLP) -> self.act (SideAct, not visible to msrewrite) may write" in error
    assert "pass --assume-pure SideAct if it does not; once that is lifted: " in error, error
    assert f"line {state}: scale_rows (not visible to msrewrite) may write module state 'self.shared_experts'" in error
    assert "checked: with all of --assume-pure SideAct --assume-pure scale_rows the analysis lets it through" in error
    assert suggested(error) == [
        "apply",
        "--case",
        "moe-shared-expert",
        str(path),
        "--assume-pure",
        "SideAct",
        "--assume-pure",
        "scale_rows",
    ]


def test_the_suggested_command_edits(tmp_path):
    path = write(tmp_path, TWO_ROUNDS)
    result = main_in_process(*suggested(refused(path)))
    assert result.returncode == 0, result.stderr
    assert "self.shared_experts(x)" in result.stdout and "vouched for with --assume-pure: SideAct, scale_rows" in (
        result.stderr
    )


@pytest.mark.slow  # runs the model through verify
def test_the_suggested_command_verifies(tmp_path):
    path = write(tmp_path, TWO_ROUNDS)
    result = run_main(*suggested(refused(path)), "--verify")
    assert result.returncode == 0, result.stderr
    assert "verify" in result.stderr


def test_a_name_given_already_is_not_suggested_again(tmp_path):
    path = write(tmp_path, TWO_ROUNDS)
    error = refused(path, "--assume-pure", "SideAct")
    assert "SideAct" not in error.split("; this command edits: ")[0], error
    assert suggested(error)[-4:] == ["--assume-pure", "SideAct", "--assume-pure", "scale_rows"]


def test_protect_clone_is_the_command_where_it_is_the_remedy():
    """--protect none refuses a main-path write a snapshot fixes: the command swaps in clone."""
    path = ADVERSARIAL / "augassign_keeps_alias.py"
    error = refused(path, "--protect", "none")
    assert (
        "pass --protect clone to snapshot it at the fork; checked: with --protect clone the analysis lets it through"
        in (error)
    )
    args = suggested(error)
    assert args[-2:] == ["--protect", "clone"] and "none" not in args, args
    result = main_in_process(*args)
    assert result.returncode == 0 and "_ms_snapshot(x)" in result.stdout, result.stderr


def test_a_refusal_that_vouching_does_not_lift_gets_no_command(tmp_path):
    """The first refusal is lifted, the next is not (a proved write of the state the side reads):
    the refusal names both and gives no command."""
    path = write(
        tmp_path,
        TWO_ROUNDS.replace("y = scale_rows(self.shared_experts.proj.weight, y)", "self.shared_experts.calls = 1"),
    )
    error = refused(path)
    assert "pass --assume-pure SideAct if it does not; even with --assume-pure SideAct: line" in error, error
    assert "writes module state 'self.shared_experts' while the side stream reads it" in error, error
    assert "this command edits" not in error


def test_blockers_wording():
    assert (
        _blockers(["A"], ("X",), False, edits=True) == "A; checked: with --assume-pure X the analysis lets it through"
    )
    assert _blockers(["A", "B", "C"], ("X", "Y"), True, edits=True) == (
        "A; once that is lifted: B; once that is lifted: C; checked: with all of --assume-pure X --assume-pure Y "
        "--protect clone the analysis lets it through"
    )
    assert _blockers(["A", "B"], ("X",), False) == "A; even with --assume-pure X: B"


# "may write" only where it is not proved ---------------------------------------------------


def test_the_fork_waits_for_a_call_that_may_write(tmp_path):
    path = write(tmp_path, FORK_WAITS)
    error = refused(path)
    prep = line_of(path, "self.prep(x)")
    assert (
        f"(the fork waits for line {prep}, where self.prep (Prep, not visible to msrewrite) may write 'x' before the "
        "side work reads it; pass --assume-pure Prep if it does not)" in error
    ), error
    assert "which writes 'x'" not in error
    assert suggested(error)[-2:] == ["--assume-pure", "Prep"]
    assert main_in_process(*suggested(error)).returncode == 0


def test_the_fork_waits_for_a_proved_write(tmp_path):
    path = write(tmp_path, FORK_WAITS.replace("        self.prep(x)\n", "        x.mul_(2)\n"))
    error = refused(path)
    assert f"(the fork waits for line {line_of(path, 'x.mul_(2)')}, which writes 'x' before the side work" in error
    assert "this command edits" not in error


def test_why_a_callee_is_unknown_says_where_its_source_was_looked_for(tmp_path):
    error = refused(write(tmp_path, NO_SOURCE), "--protect", "none")
    assert "(why unknown: Router, FusedMoE: no source found for nowhere_pkg.layers; searched " in error, error
    searched = error.split("; searched ", 1)[1].split(")", 1)[0].split(", ")
    assert str(tmp_path) in searched or any(Path(p).is_dir() for p in searched), searched
    assert suggested(error)[-4:] == ["--assume-pure", "Router", "--assume-pure", "FusedMoE"]


# No false writes: an augmented assignment writes its target, not its right side ----------


def _storage(lines: list[str], params: list[str]):
    facts = [dataclasses.replace(node_facts(cst.parse_statement(s)), index=i) for i, s in enumerate(lines)]
    return facts, Storage(facts, params)


def test_augmented_assignment_writes_its_target_not_what_it_reads():
    facts, storage = _storage(["h = x.view(-1)\n", "h *= self.scale\n", "h.add_(1)\n"], ["x"])
    assert storage.write_reach(facts[1], "h", 1) == {("param", "x")}
    assert ("param", "x") in storage.write_reach(facts[2], "h", 2)  # h keeps x's storage


@pytest.mark.parametrize("op", ["-=", "/=", "//=", "**=", "%=", "@=", "<<=", ">>="])
def test_an_operator_whose_result_holds_nothing_of_the_right_side_links_nothing(op):
    facts, storage = _storage(["h = x\n", f"h {op} self.scale\n"], ["x"])
    assert storage.held("h", 2) == {("param", "x")}


def test_a_list_extended_in_place_holds_the_right_side_after_its_own_write():
    facts, storage = _storage(["h = x\n", "h += [y]\n", "h[0].add_(1)\n"], ["x", "y"])
    assert storage.write_reach(facts[1], "h", 1) == {("param", "x")}
    assert storage.write_reach(facts[2], "h", 2) == {("param", "x"), ("param", "y")}
    # a later write in the same statement reaches what the extension put in
    facts, storage = _storage(["h = x\n", "if c:\n    h += [y]\n    h[0].add_(1)\n"], ["x", "y"])
    assert ("param", "y") in storage.write_reach(facts[1], "h", 1)


def test_an_in_place_operator_on_module_state_writes_it():
    assert "self.w" in node_facts(cst.parse_statement("self.w *= 2\n")).mutates


def test_reading_an_attribute_in_an_augmented_assignment_is_no_state_write():
    """The must-edit twin of augassign_writes_attribute (both run through verify in
    test_adversarial.py): SGLang's `final_hidden_states *= self.routed_scaling_factor`."""
    result = main_in_process("apply", "--case", "moe-shared-expert", str(ADVERSARIAL / "augassign_reads_attribute.py"))
    assert result.returncode == 0, result.stderr
    error = refused(ADVERSARIAL / "augassign_writes_attribute.py")
    assert "writes module state 'self.scale' while the side stream reads it" in error, error
