"""One refusal names every callee msrewrite cannot see into (issue 10, item 3).

A main path whose submodule passes the side's input through three opaque layers (built at run
time, so their source cannot be read) used to be refused naming one of them; vouching for it
moved the refusal to the next. Now the refusal names all three and the exact `--assume-pure`
options, and those options let the edit through (verify proves it). With two of the three the
refusal names the one left. The same goes for unseen callees on the side branch, which a
snapshot cannot help with: they are named in the same refusal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_main
from msrewrite.analyze.branch import MAX_DESCRIBED, MAX_VOUCHED, _named, _vouch_options, vouch_names
from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

SOURCE = '''\
import torch
from torch import nn


def _opaque(name, scale):
    # built at run time: msrewrite cannot read its source (like a kernel library's layer)
    def forward(self, x):
        return x * scale

    return type(name, (nn.Module,), {"forward": forward})


PreNorm = _opaque("PreNorm", 0.5)
Scale = _opaque("Scale", 2.0)
Shift = _opaque("Shift", 1.5)
SideAct = _opaque("SideAct", 3.0)


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.pre = SIDE_PRE

    def forward(self, x):
        return self.down(torch.relu(self.up(self.pre(x))))


class Mixer(nn.Module):
    """The main work: the input goes through three layers msrewrite cannot see into."""

    def __init__(self, d):
        super().__init__()
        self.norm = PreNorm()
        self.scale = Scale()
        self.shift = Shift()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        h = h + self.scale(x) * self.shift(x)
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.mixer = Mixer(d)
        self.shared_experts = MLP(d)

    def forward(self, x):
        shared = self.shared_experts(x)
        y = self.mixer(x)
        return y + shared


def make():
    torch.manual_seed(0)
    return Block().eval(), (torch.randn(8, 16),)
'''

THREE = ("PreNorm", "Scale", "Shift")


def model(tmp_path: Path, side_pre: str = "nn.Identity()") -> Path:
    path = tmp_path / "block.py"
    path.write_text(SOURCE.replace("SIDE_PRE", side_pre))
    return path


def edit(path: Path, protect: str = "", assume_pure: tuple[str, ...] = ()) -> Path:
    src = load(path)
    steps = case_steps(
        path,
        src.text,
        src.module,
        "moe-shared-expert",
        "eager",
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
        protect=protect,
        assume_pure=assume_pure,
    )
    edited = path.with_name(f"{path.stem}_ms.py")
    edited.write_text(steps[-1].new)
    return edited


def refusal(path: Path, **options) -> str:
    with pytest.raises(NothingToDo) as err:
        edit(path, **options)
    return str(err.value)


def options(*names: str) -> str:
    return " ".join(f"--assume-pure {n}" for n in names)


def test_one_refusal_names_all_three_unseen_callees(tmp_path):
    why = refusal(model(tmp_path))
    assert "\n" not in why
    for attr, name in zip(("norm", "scale", "shift"), THREE, strict=True):
        assert f"self.mixer (Mixer) -> self.{attr} ({name}, not visible to msrewrite)" in why, why
    assert f"may write 'x' which the side stream reads; pass --protect clone or {options(*THREE)}" in why, why


@pytest.mark.slow  # runs the model through verify
def test_the_options_the_refusal_names_let_the_edit_through_and_it_verifies(tmp_path):
    """`apply --verify` with exactly the options the refusal printed."""
    path = model(tmp_path)
    result = run_main("apply", "--case", "moe-shared-expert", str(path), *options(*THREE).split(), "--verify")
    assert result.returncode == 0, result.stderr
    assert "trust boundary (callees not seen into): none" in result.stderr
    assert f"vouched for with --assume-pure: {', '.join(THREE)}" in result.stderr
    edited = edit(path, assume_pure=THREE)
    checked = verify_files(edited, original=path)
    assert checked.ok, checked.problems


@pytest.mark.parametrize("left", THREE)
def test_vouching_for_two_names_the_one_left(tmp_path, left):
    why = refusal(model(tmp_path), assume_pure=tuple(n for n in THREE if n != left))
    assert f"({left}, not visible to msrewrite) may write 'x'" in why, why
    assert f"pass --protect clone or --assume-pure {left}; " in why, why
    assert why.endswith(f"; checked: with --assume-pure {left} the analysis lets it through"), why
    assert all(f"({n}," not in why for n in THREE if n != left), why


@pytest.mark.slow  # runs the model through verify
def test_protect_clone_lists_every_callee_in_the_trust_boundary_and_verifies(tmp_path):
    path = model(tmp_path)
    result = run_main("apply", "--case", "moe-shared-expert", str(path), "--protect", "clone", "--verify")
    assert result.returncode == 0, result.stderr
    boundary = next(line for line in result.stderr.splitlines() if "trust boundary" in line)
    for name in THREE:
        assert f"({name}, not visible to msrewrite)" in boundary, boundary


@pytest.mark.slow  # runs the model through verify
def test_unseen_callees_of_the_side_branch_are_named_in_the_same_refusal(tmp_path):
    """SideAct (in the shared expert) may write what the main path reads: a snapshot cannot help
    there, so the refusal gives both ways through, each complete."""
    path = model(tmp_path, side_pre="SideAct()")
    why = refusal(path)
    line = path.read_text().splitlines().index("        shared = self.shared_experts(x)") + 1
    assert (
        f"on the side branch, line {line}: self.shared_experts (MLP) -> self.pre (SideAct, not visible to msrewrite)"
        in why
    ), why
    assert f"pass {options(*THREE, 'SideAct')}, or --protect clone {options('SideAct')}; " in why, why
    assert why.endswith(f"; checked: with {options(*THREE, 'SideAct')} the analysis lets it through"), why
    assert "a snapshot cannot help here; pass --assume-pure SideAct if it does not" in refusal(path, protect="clone")
    for how in ({"assume_pure": (*THREE, "SideAct")}, {"assume_pure": ("SideAct",), "protect": "clone"}):
        checked = verify_files(edit(path, **how), original=path)
        assert checked.ok, (how, checked.problems)


def test_the_naming_is_bounded_and_says_how_many_more():
    callees = [
        f"self.mixer (Mixer) -> self.l{i} (Layer{i:02}, not visible to msrewrite)" for i in range(MAX_VOUCHED + 3)
    ]
    text = _vouch_options(callees)
    assert text.count("--assume-pure") == MAX_VOUCHED and text.endswith("(and 3 more, not named here)"), text
    named = _named(callees, MAX_DESCRIBED)
    assert named.count("not visible") == MAX_DESCRIBED
    assert named.endswith(f"and {len(callees) - MAX_DESCRIBED} more unseen callees"), named


def test_a_layer_further_out_that_is_named_covers_the_chains_through_it():
    callees = [
        "self.experts (FusedMoE) -> self.dispatcher.dispatch (create_moe_dispatcher, not visible to msrewrite)",
        "self.experts (FusedMoE) -> StandardCombineInput (not visible to msrewrite)",
        "self.gate (ReplicatedLinear) -> self.quant_method.apply (UnquantizedLinearMethod, not visible to msrewrite)",
    ]
    assert vouch_names(callees) == ["FusedMoE", "UnquantizedLinearMethod"]
    assert _named(callees, 4).count("FusedMoE") == 1  # one chain per layer described, then how many more


def test_a_chain_of_functions_is_vouched_for_by_the_function_that_makes_the_unseen_call():
    """Not each call inside a package's fused_moe (a build step, a kernel launch): fused_moe itself,
    whose source a reviewer reads; the analyzed class's own helper is not vouched for whole."""
    callees = [
        "fused_moe -> BuildSpec (not visible to msrewrite)",
        "fused_moe -> PlatformInfo.detect (not visible to msrewrite)",
        "self._route -> router_gemv -> triton.cdiv (not visible to msrewrite)",
        "self._route -> topk_output._replace (not visible to msrewrite)",
        "self.experts (get_moe_impl_class(quant_config), not visible to msrewrite)",
    ]
    assert vouch_names(callees) == ["fused_moe", "router_gemv", "topk_output._replace", "experts"]


def test_only_names_assume_pure_takes_are_printed():
    """A Triton launch has no name to vouch for: the function that launches it does; called
    directly, the refusal says that no name vouches for it."""
    inside = ["fused_moe -> invoke_kernel -> fused_moe_kernel[grid] (not visible to msrewrite)"]
    assert vouch_names(inside) == ["invoke_kernel"]
    direct = ["fused_moe_kernel[grid] (not visible to msrewrite)", "self.experts (FusedMoE, not visible to msrewrite)"]
    text = _vouch_options(direct)
    assert text.startswith("--assume-pure FusedMoE (no name --assume-pure takes vouches for fused_moe_kernel[grid]"), (
        text
    )
