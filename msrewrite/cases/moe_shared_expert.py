"""moe-shared-expert: run an MoE block's shared expert on a side stream.

The shared expert (`shared_experts`, `shared_expert`, `shared_mlp`, with or without a gate such as
`shared_expert_gate`) reads only the block's input, while the router and routed experts run on
the main stream; both meet at an add (plain, in-place, or a fused op's argument). The side
branch is issued as early as its inputs exist, so it overlaps routing, dispatch and the experts,
and the main stream waits for it right before the first consumer. An inline call in the join
(`h = h + self.shared_experts(x)`) is hoisted into a temporary first.

Seen in DeepSeek-V3/V3.2/R1, GLM-4.5/5, Qwen2/3-MoE, Qwen3-Next, Hunyuan, Kimi-K2 and others.
Modes: eager, npugraph-ex, ge-graph, cuda.
"""

from __future__ import annotations

from msrewrite.cases._base import Invalid, SeedCase, describe_lines

SHARED_EXPERT_ATTRS = frozenset({"shared_experts", "shared_expert", "shared_mlp", "shared_expert_gate"})


def is_shared_expert_call(callee: str) -> bool:
    """`callee` is the dotted name after "self.", e.g. "shared_expert.down_proj"; a private
    attribute of the same name counts (vllm-ascend's `self._shared_experts(...)`)."""
    return callee.split(".")[0].lstrip("_") in SHARED_EXPERT_ATTRS


def describe(branch) -> str:
    return "shared expert on a side stream: " + describe_lines(branch)


# Declared examples (tests/test_case_examples.py runs them; docs/cases.md shows them).
# VALID: the shared expert reads only the block's input; the routed experts run meanwhile.
VALID = """import torch
from torch import nn


class MoeBlock(nn.Module):
    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.shared_experts = nn.Linear(hidden, hidden)

    def forward(self, x):
        shared = self.shared_experts(x)
        weights = torch.softmax(self.gate(x), dim=-1)
        routed = sum(expert(x) * weights[:, i : i + 1] for i, expert in enumerate(self.experts))
        return routed + shared


def make():
    torch.manual_seed(0)
    return MoeBlock().eval(), (torch.randn(3, 16),)
"""
# INVALID: the main path writes the shared expert's input in place before the join.
INVALID = """import torch
from torch import nn


class MoeBlock(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.experts = nn.Linear(hidden, hidden)
        self.shared_experts = nn.Linear(hidden, hidden)

    def forward(self, x):
        shared = self.shared_experts(x)
        x.mul_(2.0)
        return self.experts(x) + shared
"""


CASE = SeedCase(
    name="moe-shared-expert",
    summary="MoE shared expert on a side stream, overlapping the router and routed experts",
    modes=("eager", "npugraph-ex", "ge-graph", "cuda"),
    is_seed=is_shared_expert_call,
    stream_tag="shared_expert",
    flag_name="ENABLE_MOE_SHARED_EXPERT_STREAM",
    describe=describe,
    what=("the shared expert", "the routed experts"),
    order=1,
    golden_examples=("deepseek_moe", "qwen_gated_moe", "inplace_moe", "guarded_moe"),
    mutant_modes=("eager", "cuda", "npugraph-ex"),
    mutant_examples=("deepseek_moe", "qwen_gated_moe", "guarded_moe"),
    valid=(VALID,),
    # refused with --protect none; by default (auto) the side stream reads a snapshot of x
    invalid=(
        Invalid(
            INVALID, "writes 'x' in place while the side stream reads it; pass --protect clone", ("--protect", "none")
        ),
    ),
)
