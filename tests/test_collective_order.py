"""apply refuses to move side work that runs a collective while the main path runs one between the
fork and the join: on two streams nothing fixes the collectives' order any more, and ranks that
disagree on it hang. A callee msrewrite cannot see into may run one too, so it counts against a
collective it can see on the other side. verify catches the same reordering from the ops the run
issued (per process group), so a wrong vouch (`--assume-pure`) does not slip through.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")

HEADER = """
import socket

import torch
import torch.distributed as dist
from torch import nn

# a collective msrewrite cannot see into: the callee is looked up at run time
_reduce = getattr(dist, "all_" + "reduce")


class ReducedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 16)

    def forward(self, x):
        y = self.up(x)
        dist.all_reduce(y)
        return y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.shared_mlp = ReducedMLP()
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
"""
FOOTER = """

def make():
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""

# name -> (forward body, what the refusal names)
REFUSED = {
    "seen-on-both-sides": (
        "        s = self.shared_experts(x)\n"
        "        r = self.shared_mlp(x)\n"
        "        h = self.experts(self.gate(x))\n"
        "        dist.all_reduce(h)\n"
        "        return h + s + r\n",
        "the side branch runs a collective (line 33: self.shared_mlp) and so does the main path between "
        "the fork and the join (line 35: dist.all_reduce)",
    ),
    "unseen-on-the-side": (
        "        s = self.shared_experts(x)\n"
        "        _reduce(s)\n"
        "        h = self.experts(self.gate(x))\n"
        "        dist.all_reduce(h)\n"
        "        return h + s\n",
        "the main path runs a collective between the fork and the join (line 35: dist.all_reduce) and the side "
        "branch calls _reduce",
    ),
    "unseen-on-the-main-path": (
        "        s = self.shared_mlp(x)\n"
        "        h = self.experts(self.gate(x))\n"
        "        _reduce(h)\n"
        "        return h + s\n",
        "the side branch runs a collective (line 32: self.shared_mlp) and the main path between the fork "
        "and the join calls _reduce",
    ),
    # the side call is hoisted out of the join statement, across the collective evaluated before it
    "hoisted-across-join-collective": (
        "        h = self.experts(self.gate(x))\n        return _reduced(h) + self.shared_mlp(x)\n",
        "and so does the main path between the fork and the join (line 33: _reduced)",
    ),
}
# accepted: no collective of the main path between the fork and the join
ACCEPTED = {
    "side-only": "        s = self.shared_mlp(x)\n        h = self.experts(self.gate(x))\n        return h + s\n",
    "main-collective-before-fork": (
        "        dist.all_reduce(x)\n"
        "        s = self.shared_mlp(x)\n"
        "        h = self.experts(self.gate(x))\n"
        "        return h + s\n"
    ),
    "main-collective-after-join": (
        "        s = self.shared_mlp(x)\n"
        "        h = self.experts(self.gate(x))\n"
        "        out = h + s\n"
        "        dist.all_reduce(out)\n"
        "        return out\n"
    ),
    "main-only": (
        "        s = self.shared_experts(x)\n"
        "        h = self.experts(self.gate(x))\n"
        "        dist.all_reduce(h)\n"
        "        return h + s\n"
    ),
}
HELPER = """

def _reduced(t):
    dist.all_reduce(t)
    return t
"""


def model(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(HEADER + body + (HELPER if "_reduced(" in body else "") + FOOTER)
    return path


def edit(path: Path, assume_pure: tuple[str, ...] = ()):
    src = load(path)
    steps = case_steps(
        path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, assume_pure=assume_pure
    )
    return steps[-1]


@pytest.mark.parametrize("name", list(REFUSED))
def test_collectives_on_both_sides_of_the_fork_are_refused(tmp_path, name):
    body, named = REFUSED[name]
    with pytest.raises(NothingToDo) as refused:
        edit(model(tmp_path, name, body))
    reason = str(refused.value)
    assert named in reason, reason
    assert "ranks that disagree on it hang; msrewrite keeps collectives in the program's order" in reason
    if "unseen" in name:  # the way through names the exact option
        assert reason.endswith(
            ", or pass --assume-pure _reduce if it runs none; checked: with --assume-pure _reduce the analysis lets "
            "it through"
        ), reason


def test_a_collective_alone_on_one_side_is_edited(tmp_path):
    for name, body in ACCEPTED.items():
        step = edit(model(tmp_path, name, body))
        assert step.plans and step.new != step.old, name


@pytest.mark.slow  # runs the model through verify
def test_verify_catches_a_wrong_vouch_for_a_collective(tmp_path):
    """`--assume-pure _reduce` vouches for a callee that does run a collective: the edit goes
    through, and verify reports the changed order of the collectives."""
    path = model(tmp_path, "vouched", REFUSED["unseen-on-the-side"][0])
    forced = edit(path, assume_pure=("_reduce",))
    edited = tmp_path / "vouched_ms.py"
    edited.write_text(forced.new)
    result = verify_files(edited, original=path, inputs=0)
    assert not result.ok
    assert any(p.startswith("collective-order: flag on: the side stream runs a collective") for p in result.problems), (
        result.problems
    )


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_collectives_in_the_same_order_verify_clean(tmp_path, name):
    path = model(tmp_path, name, ACCEPTED[name])
    step = edit(path)
    edited = tmp_path / f"{path.stem}_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, inputs=0)
    assert result.ok, result.problems
    assert result.schedules == ["early", "late", "interleaved"]
