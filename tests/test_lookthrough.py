"""Two shapes msrewrite used to refuse where a sound edit exists, and their unsound twins:

- a router picked from an `nn.ModuleDict` of same-file classes by a key (`self.routers[self.kind](x)`)
  is the union of the dict's values (built from a dict literal, `dict(...)`, or `self.routers[k] = X()`);
  a value that writes its input, or one msrewrite cannot see into, is still refused;
- a `with` of a context manager that neither orders nor frees tensors (torch.autocast, no_grad,
  inference_mode, amp.autocast, cuda.amp.autocast, profiler.record_function) around the whole body,
  fork and join inside, is edited inside it; any other context manager is refused naming it.

The edited ones run through verify (slow); the refusals are the analysis alone.
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
ADVERSARIAL = Path(__file__).parent / "adversarial"
ROUTERS = (ADVERSARIAL / "moduledict_router.py").read_text()
BUILT = 'nn.ModuleDict({"softmax": SoftmaxRouter(16), "sigmoid": SigmoidRouter(16)})'

# how `self.routers` is built (the body of __init__ line) -> the same model edited
DICTS = {
    "dict-literal": BUILT,
    "dict-call": "nn.ModuleDict(dict(softmax=SoftmaxRouter(16), sigmoid=SigmoidRouter(16)))",
    "from-a-factory": 'nn.ModuleDict({"softmax": make_router(16), "sigmoid": SigmoidRouter(16)})',
    "assigned-keys": (
        "nn.ModuleDict()\n"
        '        self.routers["softmax"] = SoftmaxRouter(16)\n'
        '        self.routers["sigmoid"] = SigmoidRouter(16)'
    ),
}
# -> (how it is built, what the refusal names): a value msrewrite cannot see into
UNSEEN_DICTS = {
    "starred-entry": ('nn.ModuleDict({"softmax": SoftmaxRouter(16), **extra_routers()})', "extra_routers"),
    "updated": ("nn.ModuleDict()\n        self.routers.update(extra_routers())", "self.routers.update"),
    "value-from-a-call": ('nn.ModuleDict({"softmax": table_router(16)})', "table_router"),
}

WITH_MODEL = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)
        self.tracker = Tracker()

    def forward(self, x):
        \"\"\"The MoE block.\"\"\"
        with CONTEXT:
            s = self.shared_experts(x)
            h = self.experts(self.gate(x))
            out = h + s
        return out


class Tracker:
    def __call__(self):
        return torch.autocast("cpu", enabled=False)


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""
CONTEXTS = {
    "autocast": 'torch.autocast("cpu", enabled=False)',
    "amp-autocast": 'torch.amp.autocast("cpu", enabled=False)',
    "cuda-amp-autocast": "torch.cuda.amp.autocast(enabled=False)",
    "no-grad": "torch.no_grad()",
    "inference-mode": "torch.inference_mode()",
    "record-function": 'torch.profiler.record_function("moe")',
    "two-at-once": 'torch.no_grad(), torch.profiler.record_function("moe")',
}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name.replace('-', '_')}.py"
    path.write_text(text)
    return path


def edit(path: Path, mode: str = "eager"):
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", mode, None, FLAG, None)[-1]


def mode_of(name: str) -> str:
    """torch.cuda in the function: msrewrite keeps it CUDA (it never mixes torch.npu in)."""
    return "cuda" if "cuda" in name else "eager"


def verify(tmp_path: Path, path: Path, text: str):
    edited = tmp_path / f"{path.stem}_ms.py"
    edited.write_text(text)
    return verify_files(edited, original=path, inputs=0)


def routers(tmp_path: Path, name: str, built: str, key: str = "self.kind") -> Path:
    text = ROUTERS.replace(BUILT, built).replace("self.routers[self.kind](x)", f"self.routers[{key}](x)")
    return write(
        tmp_path,
        name,
        text
        + "\n\ndef make_router(d):\n    return SoftmaxRouter(d)\n\n\ndef extra_routers():\n    return {}\n"
        # a table filled at import time may hold anything: its entries are not followed
        + '\n\nROUTERS = {"softmax": SoftmaxRouter}\n\n\ndef table_router(d):\n    return ROUTERS["softmax"](d)\n',
    )


@pytest.mark.parametrize("name", list(DICTS))
@pytest.mark.parametrize("key", ["self.kind", '"sigmoid"'])
def test_moduledict_router_is_seen_into(tmp_path, name, key):
    step = edit(routers(tmp_path, name, DICTS[name], key))
    assert step.plans[0].trust_boundary == (), step.plans[0].trust_boundary


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize("name", list(DICTS))
def test_moduledict_router_edit_verifies_clean(tmp_path, name):
    path = routers(tmp_path, name, DICTS[name])
    result = verify(tmp_path, path, edit(path).new)
    assert result.ok, result.problems
    assert "train" in result.scenarios and result.schedules == ["early", "late", "interleaved"]


def test_moduledict_value_that_writes_its_input_is_refused(tmp_path):
    path = write(tmp_path, "writes", (ADVERSARIAL / "moduledict_router_writes_input.py").read_text())
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    assert "writes 'x' in place while the side stream reads it" in str(refused.value), str(refused.value)


@pytest.mark.parametrize("name", list(UNSEEN_DICTS))
def test_moduledict_value_not_seen_into_is_refused_naming_it(tmp_path, name):
    built, named = UNSEEN_DICTS[name]
    with pytest.raises(NothingToDo) as refused:
        edit(routers(tmp_path, name, built))
    message = str(refused.value)
    assert f"self.routers ({named}" in message and "not visible to msrewrite" in message, message


def with_model(tmp_path: Path, name: str, context: str) -> Path:
    return write(tmp_path, name, WITH_MODEL.replace("CONTEXT", context))


@pytest.mark.parametrize("name", list(CONTEXTS))
def test_transparent_with_around_the_body_is_edited_inside_it(tmp_path, name):
    step = edit(with_model(tmp_path, name, CONTEXTS[name]), mode_of(name))
    lines = step.new.splitlines()
    opened = lines.index(f"        with {CONTEXTS[name]}:")
    fork = next(i for i, line in enumerate(lines) if "wait_stream(current_stream)" in line)
    join = next(i for i, line in enumerate(lines) if "current_stream.wait_stream(" in line)
    ret = lines.index("        return out")
    assert opened < fork < join < ret, step.new
    # everything from the `with` to the `return` is inside it
    assert all(not line or line.startswith(" " * 12) for line in lines[opened + 1 : ret]), step.new
    assert lines[opened - 1].strip() == '"""The MoE block."""'


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize("name", list(CONTEXTS))
def test_transparent_with_edit_verifies_clean(tmp_path, name):
    path = with_model(tmp_path, name, CONTEXTS[name])
    result = verify(tmp_path, path, edit(path, mode_of(name)).new)
    assert result.ok, result.problems
    assert result.schedules == ["early", "late", "interleaved"]


# a same-file callable, a context manager of the standard library, and one that orders draws
@pytest.mark.parametrize("context", ["self.tracker()", "contextlib.nullcontext()", "torch.random.fork_rng()"])
def test_other_context_managers_keep_the_refusal(tmp_path, context):
    path = with_model(tmp_path, "other", context)
    with pytest.raises(NothingToDo) as refused:
        edit(path)
    # named: the side work cannot leave it, and no join goes into it
    assert f"the side call sits inside `with {context}:` (line 16), a context manager msrewrite cannot see" in str(
        refused.value
    ), str(refused.value)


def test_join_after_the_with_keeps_the_refusal(tmp_path):
    text = WITH_MODEL.replace("CONTEXT", "torch.no_grad()").replace(
        "            out = h + s\n        return out\n", "        return h + s\n"
    )
    with pytest.raises(NothingToDo) as refused:
        edit(write(tmp_path, "join_after", text))
    assert "does not split" in str(refused.value)


SEQUENTIAL = """
import torch
from torch import nn


class Scale(nn.Module):
    def forward(self, x):
        BODY


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Sequential(nn.Linear(16, 16))
        self.gate.FILL
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.experts(self.gate(x))
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""


@pytest.mark.parametrize("fill", ["append(Scale())", 'add_module("scale", Scale())', "extend([Scale()])"])
def test_module_put_into_a_container_after_it_is_built_counts(tmp_path, fill):
    """`self.gate = nn.Sequential(...)` then `self.gate.append(Scale())`: calling self.gate runs
    Scale too (it was taken as the constructor's modules alone, and a Scale that writes its input
    was edited)."""
    text = SEQUENTIAL.replace("FILL", fill)
    with pytest.raises(NothingToDo) as refused:
        edit(write(tmp_path, "writes", text.replace("BODY", "return x.mul_(0.5)")))
    assert "writes 'x' in place while the side stream reads it (inside self.gate(...)" in str(refused.value)
    step = edit(write(tmp_path, "pure", text.replace("BODY", "return x * 0.5")))
    assert step.plans[0].trust_boundary == ()


@pytest.mark.slow  # runs verify
def test_module_appended_to_a_container_verifies_clean(tmp_path):
    path = write(tmp_path, "pure", SEQUENTIAL.replace("FILL", "append(Scale())").replace("BODY", "return x * 0.5"))
    result = verify(tmp_path, path, edit(path).new)
    assert result.ok, result.problems
