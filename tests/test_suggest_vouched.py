"""suggest takes what apply takes from a reviewer (`--assume-pure`, `--protect`) and proposes the
edits apply makes with them: a snapshot edit by default where the main path may write a side
input, the reason where it cannot, and a command line that carries the options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from msrewrite.commands.suggest import run_suggest
from msrewrite.errors import BadInput

MODEL = """import torch
from torch import nn
from helperlib import fused_scale


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)
        g = fused_scale(x)  # unseen: may write x, which the shared expert reads
        h = self.experts(g)
        return h + s
"""


def suggest(tmp_path: Path, capsys, **options) -> dict:
    path = tmp_path / "vouched_block.py"
    path.write_text(MODEL)
    run_suggest(files=[path], static=True, json_out=True, **options)
    return json.loads(capsys.readouterr().out)


def shared_candidates(data: dict) -> list[dict]:
    return [c for c in data["candidates"] if c["plan"]["side"][0]["source"] == "s = self.shared_experts(x)"]


def test_default_proposes_the_snapshot_edit(tmp_path, capsys):
    (candidate, *_) = shared_candidates(suggest(tmp_path, capsys))
    assert candidate["plan"]["protect_inputs"] == ["x"]
    assert candidate["plan"]["trust_boundary"] == ["fused_scale (not visible to msrewrite)"]
    assert "--assume-pure" not in candidate["command"] and "--protect" not in candidate["command"]


def test_protect_none_refuses_and_says_why(tmp_path, capsys):
    data = suggest(tmp_path, capsys, protect="none")
    assert shared_candidates(data) == []
    reasons = [r["reason"] for r in data["refused"]]
    assert any("fused_scale (not visible to msrewrite) may write 'x'" in r and "--protect clone" in r for r in reasons)


def test_assume_pure_needs_no_snapshot_and_the_command_carries_it(tmp_path, capsys):
    (candidate, *_) = shared_candidates(suggest(tmp_path, capsys, assume_pure=("fused_scale",), protect="none"))
    assert candidate["plan"]["protect_inputs"] == [] and candidate["plan"]["assume_pure"] == ["fused_scale"]
    assert candidate["command"].endswith(
        " --assume-pure fused_scale --protect none " + str(tmp_path / "vouched_block.py")
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"protect": "sometimes"}, "--protect must be one of auto, none, clone, got 'sometimes'"),
        ({"assume_pure": ("a b",)}, "--assume-pure needs a class, function or attribute name, got 'a b'"),
    ],
)
def test_bad_options_are_bad_input(tmp_path, options, message):
    path = tmp_path / "vouched_block.py"
    path.write_text(MODEL)
    with pytest.raises(BadInput, match=message):
        run_suggest(files=[path], static=True, json_out=True, **options)


@pytest.mark.slow  # subprocesses: suggest's plan, carried out by apply --plan, and verify
def test_the_suggested_snapshot_plan_applies_and_verifies(tmp_path):
    path = tmp_path / "vouched_block.py"
    path.write_text(MODEL + "\n\ndef make():\n    torch.manual_seed(0)\n    return Block(), (torch.randn(2, 8, 16),)\n")
    (tmp_path / "helperlib.py").write_text("def fused_scale(x):\n    return x.mul_(2)\n")  # it does write x
    cli = [sys.executable, "-m", "msrewrite"]
    plans = subprocess.run([*cli, "suggest", "--static", "--json", str(path)], capture_output=True, text=True)
    (tmp_path / "plans.json").write_text(plans.stdout)
    sources = [c["plan"]["side"][0]["source"] for c in json.loads(plans.stdout)["candidates"]]
    rank = 1 + sources.index("s = self.shared_experts(x)")
    applied = subprocess.run(
        [*cli, "apply", "--plan", str(tmp_path / "plans.json"), "--candidate", str(rank), "--verify", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert applied.returncode == 0, applied.stderr
    assert "OK: outputs equal exactly" in applied.stderr and "sanitizer clean" in applied.stderr, applied.stderr
