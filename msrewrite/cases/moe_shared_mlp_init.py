"""moe-shared-mlp-init: the shared MLP on a side stream that the model creates once and hands down.

HunyuanImage-3.0's variant of the shared-expert overlap: the side stream is not looked up inside
forward but created when the model is built and passed to every MoE layer through constructor
keyword arguments (each class on the way gets a `shared_mlp_stream=None` keyword; a layer built
directly falls back to the same process-wide stream). Fork and join use fresh events on each
call, recorded on the stream that produced the data. A monkey-patch module that reassigns
`Class.forward = moe_forward` is edited in its free function, which then takes the stream from the
process-wide cache.

Modes: eager and cuda. Not npugraph-ex: events created per call are not stable across graph
capture and replay (use moe-shared-expert, which creates them once). Not ge-graph: torchair
streams are tags, so there is no stream object to hand down.
"""

from __future__ import annotations

from msrewrite.cases._base import Invalid, SeedCase
from msrewrite.cases.moe_shared_expert import describe, is_shared_expert_call

# Declared examples (tests/test_case_examples.py runs them; docs/cases.md shows them).
# VALID: the shared MLP on a stream the model hands down.
VALID = """import torch
from torch import nn


class MoeBlock(nn.Module):
    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.shared_mlp = nn.Linear(hidden, hidden)

    def forward(self, x):
        shared = self.shared_mlp(x)
        weights = torch.softmax(self.gate(x), dim=-1)
        routed = sum(expert(x) * weights[:, i : i + 1] for i, expert in enumerate(self.experts))
        return routed + shared


def make():
    torch.manual_seed(0)
    return MoeBlock().eval(), (torch.randn(3, 16),)
"""
# INVALID: the main path writes the shared MLP's input in place before the join.
INVALID = """import torch
from torch import nn


class MoeBlock(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.experts = nn.Linear(hidden, hidden)
        self.shared_mlp = nn.Linear(hidden, hidden)

    def forward(self, x):
        shared = self.shared_mlp(x)
        x.mul_(2.0)
        return self.experts(x) + shared
"""


CASE = SeedCase(
    name="moe-shared-mlp-init",
    summary="shared MLP on a side stream created at model construction and handed to every MoE layer",
    modes=("eager", "cuda"),
    is_seed=is_shared_expert_call,
    stream_tag="shared_mlp",
    flag_name="ENABLE_SHARED_MLP_STREAM",
    describe=describe,
    what=("the shared MLP", "the routed experts"),
    stream_source="constructor",
    sync="events",
    notes="not npugraph-ex: per-call events change between capture and replay; not ge-graph: no stream object",
    order=3,
    golden_examples=("hunyuan_moe", "hunyuan_moe_patch"),
    mutant_modes=("eager", "cuda"),
    mutant_examples=("hunyuan_moe",),
    valid=(VALID,),
    # refused with --protect none; by default (auto) the side stream reads a snapshot of x
    invalid=(Invalid(INVALID, "writes 'x' in place while the side stream reads it", ("--protect", "none")),),
)
