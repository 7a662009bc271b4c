"""A model file that registers operators at import time, loaded again and again by verify.

verify loads the original file, the edited file, and the edited file afresh for every run, all in
one process. torch's `custom_op` destroys the earlier registration on each load, leaving the
modules loaded before with a dangling operator handle (a segfault in CI, found there); torch's
`Library.define` refuses the second load. Both must verify as a user would run them, and a
second registration that differs must be refused in one line, not run.
"""

from __future__ import annotations

import pytest

from helpers import run_cli
from msrewrite.errors import BadInput
from msrewrite.harness import load_module

BLOCK = """

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.gate(MIX(x, self.w))
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""

CUSTOM_OP = """import torch
from torch import nn


@torch.library.custom_op("msr_reload_c::mix", mutates_args=())
def mix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w
""" + BLOCK.replace("MIX", "mix")

LIBRARY = """import torch
from torch import nn


def _mix(x, w):
    return x * w


_LIB = torch.library.Library("msr_reload_d", "FRAGMENT")
_LIB.define("mix(Tensor x, Tensor w) -> Tensor")
_LIB.impl("mix", _mix, "CompositeImplicitAutograd")
""" + BLOCK.replace("MIX", "torch.ops.msr_reload_d.mix")


@pytest.mark.slow  # the CLI, as a user runs it
@pytest.mark.parametrize("text", [CUSTOM_OP, LIBRARY], ids=["custom_op", "library_define"])
def test_a_file_that_registers_operators_is_edited_and_verified(tmp_path, text):
    model = tmp_path / "model.py"
    model.write_text(text)
    done = run_cli("apply", "--case", "moe-shared-expert", str(model), "--verify")
    assert done.returncode == 0, done.stderr
    assert "OK: outputs equal" in done.stderr
    assert "Overriding a previously registered kernel" not in done.stderr


def test_a_reloaded_custom_op_is_the_first_one_kept_alive(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(CUSTOM_OP.replace("msr_reload_c", "msr_reload_k"))
    first = load_module(model, name="_msr_reload_first")
    second = load_module(model, name="_msr_reload_second")
    assert second.mix is first.mix  # the first module's handle is still the live operator
    x = torch_ones()
    assert first.mix(x, x).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("text", [CUSTOM_OP, LIBRARY], ids=["custom_op", "library_define"])
def test_a_second_registration_that_differs_is_refused(tmp_path, text):
    text = text.replace("msr_reload_c", "msr_reload_x").replace("msr_reload_d", "msr_reload_y")
    model = tmp_path / "model.py"
    model.write_text(text)
    load_module(model, name="_msr_reload_a")
    edited = tmp_path / "edited.py"
    edited.write_text(
        text.replace("return x * w", "return x * w + 1")
        .replace("_mix, ", "_mix2, ")
        .replace("\n\n_LIB", "\n\n_mix2 = lambda x, w: x + w\n_LIB")
    )
    with pytest.raises(BadInput, match=r"cannot import .*edited.py: operator msr_reload_[xy]::mix is registered twice"):
        load_module(edited, name="_msr_reload_b")


def torch_ones():
    import torch

    return torch.ones(2)
