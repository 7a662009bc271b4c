"""Virtual dispatch: what a `self.m(...)` or `self.sub(...)` call may run is every override and
patch the analysis reads, not only the base class's method.

The edited base forward calls `self.routed(x)`; a subclass in the same file overrides it with an
in-place write of x (or a subclass puts an in-place shared expert in `self.shared_experts`, or a
module-level `Moe.routed = f` / `MLP.forward = f` replaces it). Each is refused, naming the call;
the twin without the override still edits. moe-shared-expert-phased inlines the shared expert's
`forward` into the caller (both flag paths): it refuses when a subclass, a patch or a hook of the
shared expert's class is visible, since the inlined code would skip it with the flag off too.
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

MODEL = """import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, h=16, i=32):
        super().__init__()
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class Moe(nn.Module):
    def __init__(self, h=16, e=4):
        super().__init__()
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(MLP(h, 32) for _ in range(e))
        self.shared_experts = MLP(h, 32)

    def forward(self, x):
        shared = self.shared_experts(x)
        w = torch.softmax(self.gate(x), dim=-1)
        d = x * w.sum(-1, keepdim=True)
        r = self.routed(x, w) * d.sum(-1, keepdim=True)
        c = r * 0.5
        return c + shared

    def routed(self, h, w):
        return sum(ex(h) * w[..., i : i + 1] for i, ex in enumerate(self.experts))
{extra}

def make():
    torch.manual_seed(0)
    return {made}().eval(), (torch.randn(8, 16),)
"""
SUBCLASS_ROUTED = """

class Moe2(Moe):
    def routed(self, h, w):
        h.mul_(2.0)
        return super().routed(h, w)
"""
SUBCLASS_SHARED = """

class InplaceMLP(MLP):
    def forward(self, x):
        y = self.down(F.silu(self.up(x)))
        x.mul_(0.5)
        return y


class Moe2(Moe):
    def __init__(self):
        super().__init__()
        self.shared_experts = InplaceMLP(16, 32)
"""
PATCH_ROUTED = """

def _patched_routed(self, h, w):
    h.mul_(2.0)
    return sum(ex(h) * w[..., i : i + 1] for i, ex in enumerate(self.experts))


Moe.routed = _patched_routed
"""
PATCH_MLP = """

def _mlp_forward_inplace(self, x):
    y = self.down(F.silu(self.up(x)))
    x.mul_(0.5)
    return y


MLP.forward = _mlp_forward_inplace
"""
# name -> (extra code, the class make() builds, what the refusal says)
REFUSED = {
    "subclass-overrides-routed": (
        SUBCLASS_ROUTED,
        "Moe2",
        "line 27 writes 'x' in place while the side stream reads it",
    ),
    "subclass-swaps-shared-expert": (SUBCLASS_SHARED, "Moe2", "the side branch writes its input 'x' in place"),
    "patched-routed": (PATCH_ROUTED, "Moe", "(inside self.routed(...)"),
    "patched-mlp-forward": (PATCH_MLP, "Moe", "line 27 writes 'x' in place"),
}
# a subclass that overrides nothing the forward calls, and a patch that writes nothing: still edits
SAFE_SUBCLASS = """

class Moe2(Moe):
    def describe(self):
        return "moe"
"""


def _edit(tmp_path: Path, name: str, text: str, case: str = "moe-shared-expert"):
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(text)
    src = load(path)
    return path, case_steps(path, src.text, src.module, case, "eager", None, FLAG, None)[-1]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_override_or_patch_that_writes_the_side_input_is_refused(tmp_path, name):
    extra, made, why = REFUSED[name]
    with pytest.raises(NothingToDo) as refused:
        _edit(tmp_path, name, MODEL.format(extra=extra, made=made))
    assert why in str(refused.value), str(refused.value)


@pytest.mark.parametrize("case", ["moe-shared-expert", "moe-shared-expert-phased"])
def test_a_subclass_that_overrides_nothing_called_still_edits(tmp_path, case):
    _, step = _edit(tmp_path, "safe", MODEL.format(extra=SAFE_SUBCLASS, made="Moe2"), case)
    assert step.plans and not step.plans[0].trust_boundary


@pytest.mark.slow  # runs the model through verify
def test_the_override_race_is_what_verify_sees_when_the_subclass_is_built(tmp_path):
    """The edit of the safe twin, run with the overriding subclass put in: a race (what the
    refusal above keeps out); the safe twin itself verifies clean."""
    path, step = _edit(tmp_path, "twin", MODEL.format(extra=SAFE_SUBCLASS, made="Moe2"))
    edited = tmp_path / "twin_ms.py"
    edited.write_text(step.new)
    assert verify_files(edited, original=path, inputs=0).ok
    bad = tmp_path / "bad.py"
    bad.write_text(MODEL.format(extra=SUBCLASS_ROUTED, made="Moe2"))
    bad_ms = tmp_path / "bad_ms.py"
    bad_ms.write_text(step.new.replace(SAFE_SUBCLASS.strip(), SUBCLASS_ROUTED.strip()))
    result = verify_files(bad_ms, original=bad, inputs=0)
    assert not result.ok and any("race" in p for p in result.problems), result.problems


# phased: the shared expert's forward is inlined, so anything that runs in its call must be absent
HALF = """

class HalfMLP(MLP):
    def forward(self, x):
        return super().forward(x) * 0.5


class Moe2(Moe):
    def __init__(self):
        super().__init__()
        self.shared_experts = HalfMLP(16, 32)
"""
PATCH_HALF = """

def _half_forward(self, x):
    return self.down(F.silu(self.up(x))) * 0.5


if os.environ.get("USE_HALF_SHARED", "1") == "1":
    MLP.forward = _half_forward
"""
HOOK = """

class HookedMoe(Moe):
    def __init__(self):
        super().__init__()
        self.shared_experts.register_forward_hook(_halve)


def _halve(module, args, output):
    return output * 0.5
"""
PHASED_REFUSED = {
    "subclass-of-the-shared-expert": (HALF, "Moe2", "HalfMLP in this file derives from MLP"),
    "env-gated-forward-patch": (PATCH_HALF, "Moe", "MLP.forward is reassigned at module level"),
    "forward-hook": (HOOK, "HookedMoe", "register_forward_hook"),
}


@pytest.mark.parametrize("name", sorted(PHASED_REFUSED))
def test_phased_refuses_to_inline_past_a_subclass_patch_or_hook(tmp_path, name):
    extra, made, why = PHASED_REFUSED[name]
    text = MODEL.format(extra=extra, made=made).replace("import torch\n", "import os\nimport torch\n", 1)
    with pytest.raises(NothingToDo) as refused:
        _edit(tmp_path, name, text, "moe-shared-expert-phased")
    assert why in str(refused.value), str(refused.value)


@pytest.mark.slow  # runs the model through verify
def test_the_plain_phased_twin_still_edits_and_verifies(tmp_path):
    path, step = _edit(tmp_path, "plain", MODEL.format(extra="", made="Moe"), "moe-shared-expert-phased")
    edited = tmp_path / "plain_ms.py"
    edited.write_text(step.new)
    result = verify_files(edited, original=path, inputs=0)
    assert result.ok, result.problems
