"""A `None` entry in an nn.ModuleList / nn.Sequential literal runs nothing (analyze/summaries.py):
the effect of calling the container is that of its other entries, never a crash, and never less
than theirs."""

from __future__ import annotations

import libcst as cst

from msrewrite.analyze.summaries import ModuleSummaries
from msrewrite.analyze.torch_effects import CallEffect
from msrewrite.analyze.walk import Visitor

SOURCE = """
from torch import nn


class Expert(nn.Module):
    def forward(self, x):
        return x.add_(1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([Expert(), None])
        self.chain = nn.Sequential(Expert(), None)

    def forward(self, x):
        a = self.experts[0](x)
        return self.chain(a)
"""


def _effects() -> dict[str, CallEffect]:
    module = cst.parse_module(SOURCE)
    scope = ModuleSummaries(module).scope_for("Block", "forward")
    calls: list[cst.Call] = []

    class _Calls(Visitor):
        def visit_Call(self, node: cst.Call) -> None:
            calls.append(node)

    block = next(s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value == "Block")
    forward = next(s for s in block.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "forward")
    forward.body.visit(_Calls())
    return {cst.Module(body=[]).code_for_node(c.func): scope.effect_of(c) for c in calls}


def _written(effect: CallEffect) -> list[str]:
    return [cst.Module(body=[]).code_for_node(w) for w in effect.writes]


def test_none_entry_of_an_indexed_module_list_is_left_out():
    effect = _effects()["self.experts[0]"]
    assert _written(effect) == ["x"]  # the expert's in-place add still counts
    assert not effect.unknown


def test_none_entry_of_a_sequential_is_left_out():
    effect = _effects()["self.chain"]
    assert _written(effect) == ["a"]
    assert not effect.unknown
