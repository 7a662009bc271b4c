"""msrewrite's TorchDispatchModes run their handler without importing torch._dynamo (about 3 s,
most of a small model's `verify`), and through torch's dynamo-disabled handler once it is loaded;
suggest's fx tracers record stack traces without fx's filter, which imports it too."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import EXAMPLES, ROOT
from msrewrite.torch_modes import DispatchMode


def _mode_class(seen: list):
    class Recording(DispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    return Recording


def test_without_dynamo_the_handler_runs_as_written(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)

    def disable(*_args, **_kwargs):
        pytest.fail("torch._dynamo was asked for")

    monkeypatch.setattr(torch, "_disable_dynamo", disable)
    seen: list = []
    with _mode_class(seen)():
        out = torch.ones(2) + 1
    assert seen == ["aten.ones.default", "aten.add.Tensor"] and out.tolist() == [2.0, 2.0]


def test_once_dynamo_is_loaded_the_handler_is_dynamo_disabled_once(monkeypatch):
    made = []

    def disable(fn, recursive):
        made.append(recursive)

        def disabled(*args, **kwargs):
            made.append("through the disabled handler")
            return fn(*args, **kwargs)

        return disabled

    monkeypatch.setitem(sys.modules, "torch._dynamo", sys.modules.get("torch._dynamo", object()))
    monkeypatch.setattr(torch, "_disable_dynamo", disable)
    seen: list = []
    with _mode_class(seen)():
        torch.ones(2) + 1
    assert made == [True, "through the disabled handler", "through the disabled handler"]
    assert seen == ["aten.ones.default", "aten.add.Tensor"]


def test_torch_does_not_wrap_the_handler_itself():
    """torch's own wrapping (TorchDispatchMode.__init_subclass__) is the one replaced."""
    handler = _mode_class([]).__dict__["__torch_dispatch__"]
    assert (
        handler.__code__.co_filename.endswith("torch_modes.py") and handler.__wrapped__.__name__ == "__torch_dispatch__"
    )


CHILD = r"""
import sys
from pathlib import Path
import torch
from msrewrite.verify import verify_files
from msrewrite.suggest.pipeline import analyze
from msrewrite.suggest.profiles import profile

result = verify_files(Path(sys.argv[1]), original=Path(sys.argv[2]), inputs=0, train=False)
assert not result.problems, result.problems
# a model fx's plain leaf tracer takes (the meta-leaf tracer runs torch's meta functions, which import dynamo)
traced = analyze(Path(sys.argv[3]), device=profile("a3"), harness=f"{sys.argv[3]}:make")
assert traced.candidates and traced.tiers["fx"].startswith("HunyuanMoE: ok (leaf tracer"), traced.tiers
print("dynamo after verify and a traced suggest:", "torch._dynamo" in sys.modules)

from msrewrite.torch_modes import DispatchMode
seen = []
class Recording(DispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return func(*args, **(kwargs or {}))
with Recording():
    out = torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
assert out.tolist() == [3.0, 3.0, 3.0]
print("compiled under a mode:", "aten.mul.Tensor" in seen)
"""


@pytest.mark.slow
def test_verify_and_traced_suggest_leave_dynamo_unloaded_and_compile_still_runs_under_a_mode():
    golden = ROOT / "golden" / "moe-shared-expert" / "eager" / "deepseek_moe.py"
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(golden), str(EXAMPLES / "deepseek_moe.py"), str(EXAMPLES / "hunyuan_moe.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "dynamo after verify and a traced suggest: False" in run.stdout, run.stdout
    assert "compiled under a mode: True" in run.stdout, run.stdout


class _TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.first(x)
        return y + self.second(x)


def test_fx_stack_traces_give_the_forward_lines_of_each_leaf_call():
    import inspect

    from msrewrite.suggest.fxgraph import LeafTracer, module_dag

    model = _TwoBranches()
    graph = LeafTracer({"first", "second"}).trace(model)
    lines = {d["target"]: d["line"] for _, d in module_dag(graph, __file__).nodes(data=True) if d["kind"] == "module"}
    source, start = inspect.getsourcelines(_TwoBranches.forward)
    at = {name: start + next(i for i, text in enumerate(source) if f"self.{name}(" in text) for name in lines}
    assert lines == at
    frames = next(n for n in graph.nodes if n.op == "call_module" and n.target == "second").stack_trace
    assert frames.splitlines()[-1].strip() == f'File "{__file__}", line {at["second"]}, in forward', frames
