"""moe-shared-expert-phased at run time: the flag-off path is the original call, and the inlined
phases run only while calling the shared expert would run its forward alone (audit A p01-p03).

Each model here gets its subclass, patch or hook only at run time (in a make function, or in this
test), where apply cannot see it: the edit must fall back to the original call, so verify passes;
with nothing in the way the phases do run, on the side stream, between the routed steps.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from msrewrite.commands.apply import case_steps
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM", default=True)
CASE = "moe-shared-expert-phased"

MODEL = '''import types

import torch
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
        self.experts = nn.ModuleList(nn.Linear(h, h) for _ in range(e))
        self.shared_experts = MLP(h, 32)
        _instrument(self)  # what a framework does to the model at run time (nothing, or INSTRUMENT)

    def forward(self, x):
        shared = self.shared_experts(x)
        w = torch.softmax(self.gate(x), dim=-1)
        d = x * w.sum(-1, keepdim=True)
        r = sum(ex(d) * w[:, i : i + 1] for i, ex in enumerate(self.experts))
        c = r * 0.5
        return c + shared


def make():
    torch.manual_seed(0)
    return Moe().eval(), (torch.randn(8, 16),)


INSTRUMENT = ""  # each scenario's copy of this file names one


def _instrument(model):
    """Run-time changes apply cannot see (names built at run time), made in the constructor so
    that verify's rebuilt original gets them too."""
    mlp = model.shared_experts
    if INSTRUMENT == "hook":  # a forward hook (a quantization wrapper, LoRA, a profiler)
        getattr(mlp, "register_" + "forward_hook")(lambda m, i, o: o * 0.5)
    elif INSTRUMENT == "pre_hook":
        getattr(mlp, "register_" + "forward_pre_hook")(lambda m, args: (args[0] * 2,))
    elif INSTRUMENT == "subclass":  # the shared expert's class swapped for a subclass
        mlp.__class__ = type("Scaled", (MLP,), {"forward": lambda self, x: MLP.forward(self, x) * 3})
    elif INSTRUMENT == "class_patch" and not getattr(MLP, "patched", False):  # MLP.forward replaced
        original = MLP.forward
        setattr(MLP, "forward", lambda self, x: original(self, x) + 1)
        MLP.patched = True
    elif INSTRUMENT == "instance_patch":
        setattr(mlp, "forward", types.MethodType(lambda self, x: self.down(torch.relu(self.up(x))), mlp))
'''

INSTRUMENTS = ["hook", "pre_hook", "subclass", "class_patch", "instance_patch"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path, str]:
    folder = tmp_path_factory.mktemp("phased_runtime")
    original = folder / "moe.py"
    original.write_text(MODEL)
    src = load(original)
    steps = case_steps(original, src.text, src.module, CASE, "eager", None, FLAG, None, (), ("w", "d"))
    edited = folder / "moe_ms.py"
    edited.write_text(steps[-1].new)
    return original, edited, steps[-1].new


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_flag_off_path_is_the_original_call(files):
    _, _, text = files
    assert "_ms_runs_as_inlined(self.shared_experts, MLP)" in text
    forward = text[text.index("    def forward(self, x):\n        # msrewrite") :]
    off = forward[forward.index("        else:\n") :].splitlines()[1]
    assert off.strip() == "shared = self.shared_experts(x)"
    # the inlined steps run only on the side stream, under the switch
    assert forward.count("self.shared_experts.up(") == 1 and "with torch.npu.stream(" in forward


def _run(path: Path, name: str, setup=None):
    from msrewrite.runtime import install

    module = _load(path, name)
    model, inputs = module.make()
    if setup is not None:
        setup(model)
    with install() as rt, rt.record_ops() as ops, torch.no_grad():
        out = model(*inputs)
    return out, ops, module


def test_phases_run_on_the_side_stream_between_the_routed_steps(files):
    original, edited, _ = files
    expected, _, _ = _run(original, "_phased_rt_original")
    out, ops, _ = _run(edited, "_phased_rt_plain")
    assert torch.equal(out, expected)
    streams = [op.stream for op in ops]
    side = [s for s in streams if s != "main"]
    assert side, "no op ran on the side stream"
    # main, side, main, side ...: the side phases interleave with the routed path
    changes = sum(1 for a, b in zip(streams, streams[1:], strict=False) if (a == "main") != (b == "main"))
    assert changes >= 3, streams


def test_shared_expert_submodules_keep_their_hooks_on_the_phased_path(files):
    """The inlined body calls self.shared_experts.up(...): that call runs up's own hooks."""
    original, edited, _ = files

    def hook_up(model):
        model.shared_experts.up.register_forward_hook(lambda _m, _i, o: o * 0.25)

    expected, _, _ = _run(original, "_phased_rt_original_up", hook_up)
    out, ops, _ = _run(edited, "_phased_rt_up", hook_up)
    assert torch.equal(out, expected)
    assert any(op.stream != "main" for op in ops)  # the phases still run: only the submodule has a hook


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "forward_with_kwargs"])
def test_a_global_module_hook_keeps_the_original_call(files, kind):
    """torch's global module hooks (register_module_forward_hook) run on every module call: the
    edit sees one at run time and takes the original path, flag on, with no side stream."""
    from torch.nn.modules import module as nn_module

    original, edited, _ = files
    seen: list[str] = []

    def hook(module, *_rest):
        seen.append(type(module).__name__)

    register = {
        "forward": lambda: nn_module.register_module_forward_hook(hook),
        "forward_pre": lambda: nn_module.register_module_forward_pre_hook(hook),
        "forward_with_kwargs": lambda: nn_module.register_module_forward_hook(hook, with_kwargs=True),
    }[kind]
    handle = register()
    try:
        expected, _, _ = _run(original, f"_phased_rt_original_{kind}")
        wanted = list(seen)
        seen.clear()
        out, ops, _ = _run(edited, f"_phased_rt_global_{kind}")
    finally:
        handle.remove()
    assert torch.equal(out, expected)
    assert seen == wanted and "MLP" in seen  # the shared expert's call ran, with the hook
    assert all(op.stream == "main" for op in ops)


def _instrumented(folder: Path, instrument: str) -> tuple[Path, Path, str]:
    """The model with INSTRUMENT = `instrument`, and its edit."""
    folder.mkdir(parents=True, exist_ok=True)
    original = folder / "moe.py"
    original.write_text(MODEL.replace('INSTRUMENT = ""', f"INSTRUMENT = {instrument!r}"))
    src = load(original)
    steps = case_steps(original, src.text, src.module, CASE, "eager", None, FLAG, None, (), ("w", "d"))
    edited = folder / "moe_ms.py"
    edited.write_text(steps[-1].new)
    return original, edited, steps[-1].new


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize("instrument", INSTRUMENTS)
def test_runtime_subclass_patch_or_hook_falls_back_and_verifies(tmp_path, instrument):
    """Every output equals the original's, flag off and flag on, in every scenario and schedule, and
    the sanitizer is clean; verify's one finding is that the side stream stayed off, which is the
    fallback itself (the call would run more than the inlined forward)."""
    original, edited, _ = _instrumented(tmp_path, instrument)
    result = verify_files(edited, original=original)
    assert result.problems == ["flag on: no op ran on a side stream (is the flag wired?)"], result.problems


@pytest.mark.slow  # runs verify
def test_plain_model_verifies_with_ops_on_the_side_stream(files):
    original, edited, _ = files
    result = verify_files(edited, original=original)
    assert result.ok, result.problems


@pytest.mark.slow  # runs verify
def test_mutant_without_the_runtime_check_is_reported_for_a_hooked_model(tmp_path):
    """Removing the run-time check runs the inlined forward past the hook: verify must see it."""
    original, edited, text = _instrumented(tmp_path, "hook")
    check = " and _ms_runs_as_inlined(self.shared_experts, MLP)"
    assert check in text
    edited.write_text(text.replace(check, ""))
    result = verify_files(edited, original=original)
    assert not result.ok
    assert any("flag on: output 0 differs from original" in p for p in result.problems), result.problems
    assert not any(p.startswith("flag off:") for p in result.problems), result.problems
