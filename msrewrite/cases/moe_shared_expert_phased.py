"""moe-shared-expert-phased: the shared expert split into phases interleaved with the routed path.

Qwen3-Next on SGLang (cann-recipes stage1 patch 0003) and DeepSeek-V3.2's GE decode path: instead
of one side block, the shared expert is written out step by step (its submodule inlined, every
nested call bound to a name) and issued in phases: the projections right away, the activation
after the first anchor (dispatch), the down projection and gate multiply after the second (expert
compute), so each side phase runs next to a different part of the routed path. Each phase waits
for all main work issued so far (`wait_stream`; `npu_wait_tensor` on the anchor in GE mode); the
main stream joins before the final add.

Anchors are `--anchor NAME` (repeat; main-stream values in program order) or, by default, the
results of the main-path steps before the last one. The edit is two patches: the inlining
refactor, then the phases; `-o patches/stage1/` writes them with an apply_patches.sh.

Modes: eager, ge-graph, cuda. Not npugraph-ex yet: each phase would need its own capture-stable
event pair; moe-shared-expert covers npugraph-ex in one phase.
"""

from __future__ import annotations

from msrewrite.cases._base import Invalid, PhasedCase
from msrewrite.cases.moe_shared_expert import describe, is_shared_expert_call

# Declared examples (tests/test_case_examples.py runs them; docs/cases.md shows them).
# VALID: the shared expert's projections, activation and down projection go out in phases.
VALID = """import torch
from torch import nn


class SharedExpert(nn.Module):
    def __init__(self, hidden=16, inter=32):
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)))


class MoeBlock(nn.Module):
    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.shared_expert = SharedExpert(hidden)

    def forward(self, x):
        shared = self.shared_expert(x)
        weights = torch.softmax(self.gate(x), dim=-1)
        dispatched = x * weights.sum(-1, keepdim=True)
        routed = sum(expert(dispatched) * weights[:, i : i + 1] for i, expert in enumerate(self.experts))
        combined = routed * 0.5
        return combined + shared


def make():
    torch.manual_seed(0)
    return MoeBlock().eval(), (torch.randn(3, 16),)
"""
# INVALID: the routed experts read the shared expert's output: nothing runs next to it.
INVALID = """import torch
from torch import nn


class MoeBlock(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.experts = nn.Linear(hidden, hidden)
        self.shared_experts = nn.Linear(hidden, hidden)

    def forward(self, x):
        shared = self.shared_experts(x)
        out = self.experts(shared)
        return out
"""


CASE = PhasedCase(
    name="moe-shared-expert-phased",
    summary="shared expert inlined and issued in phases between dispatch, expert compute and combine",
    modes=("eager", "ge-graph", "cuda"),
    is_seed=is_shared_expert_call,
    stream_tag="shared_expert",
    flag_name="ENABLE_MOE_SHARED_EXPERT_STREAM",
    describe=describe,
    what=("the shared expert", "the routed experts"),
    notes="not npugraph-ex yet: phases would need capture-stable events each",
    order=2,
    golden_examples=("deepep_moe", "qwen_gated_moe"),
    mutant_modes=("eager",),
    mutant_examples=("deepep_moe",),
    valid=(VALID,),
    invalid=(Invalid(INVALID, "no main-path work between the fork and the join: nothing to overlap"),),
)
