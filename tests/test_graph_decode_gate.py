"""Graph modes overlap in decode only where the function takes `is_prefill` (`with_prefill`).

The recipes switch their graph-mode overlaps on with `enable_multi_streams and not is_prefill`:
prefill runs eagerly beside the graph. apply does the same by default in ge-graph and
npugraph-ex, says so with the edit, and `--gate always` (or any --gate) decides instead.
"""

from __future__ import annotations

import pytest

from helpers import run_main
from msrewrite.commands.apply import case_steps
from msrewrite.load import load
from msrewrite.plan import FlagSpec

MODEL = """import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x, PARAM=False):
        s = self.shared_experts(x)
        h = self.experts(self.gate(x))
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16), False)
"""
FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")


def plan_of(tmp_path, mode: str, param: str = "is_prefill", **options):
    path = tmp_path / "block.py"
    path.write_text(MODEL.replace("PARAM", param))
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", mode, None, FLAG, None, **options)[-1].plans[0]


@pytest.mark.parametrize("mode", ["ge-graph", "npugraph-ex"])
@pytest.mark.parametrize("param", ["is_prefill", "with_prefill"])
def test_graph_modes_overlap_in_decode_by_default(tmp_path, mode, param):
    plan = plan_of(tmp_path, mode, param)
    assert plan.flag.gate == "decode"
    assert f"--gate decode (the default for {mode} where the function takes `{param}`" in plan.summary


@pytest.mark.parametrize(
    ("mode", "param"), [("eager", "is_prefill"), ("cuda", "is_prefill"), ("ge-graph", "prefill_len")]
)
def test_no_default_gate_elsewhere(tmp_path, mode, param):
    plan = plan_of(tmp_path, mode, param)
    assert plan.flag.gate is None and "--gate decode" not in plan.summary


@pytest.mark.slow  # the CLI, and verify of the gated edit
def test_gate_always_keeps_prefill_and_the_default_edit_verifies(tmp_path):
    path = tmp_path / "block.py"
    path.write_text(MODEL.replace("PARAM", "is_prefill"))
    gated = run_main("apply", "--case", "moe-shared-expert", "--mode", "ge-graph", str(path), "--verify")
    assert gated.returncode == 0, gated.stderr
    assert "and not is_prefill" in gated.stdout and "OK: outputs equal" in gated.stderr
    always = run_main("apply", "--case", "moe-shared-expert", "--mode", "ge-graph", "--gate", "always", str(path))
    assert always.returncode == 0, always.stderr
    assert "is_prefill" not in "".join(line for line in always.stdout.splitlines() if line.startswith("+"))
    assert "--gate decode" not in always.stderr


def test_a_function_that_reassigns_is_prefill_keeps_no_default_gate(tmp_path):
    """The predicate is read at the fork: a reassigned parameter cannot tell the phase there."""
    path = tmp_path / "block.py"
    path.write_text(
        MODEL.replace("PARAM", "is_prefill").replace(
            "        s = self", "        is_prefill = bool(is_prefill)\n        s = self", 1
        )
    )
    src = load(path)
    plan = case_steps(path, src.text, src.module, "moe-shared-expert", "ge-graph", None, FLAG, None)[-1].plans[0]
    assert plan.flag.gate is None
