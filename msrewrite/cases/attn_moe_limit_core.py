"""attn-moe-limit-core: LongCat-Flash's shortcut MoE on a side stream, with AI cores split.

In a LongCat-Flash decoder layer the shortcut MoE (`self.mlp`) only reads the first sublayer's
normed hidden state, so it can run on a side stream while the dense MLP and the whole second
attention sublayer run on main; the sum joins them at the end. Both branches get a core budget
so neither tails the other (cann-recipes `LongcatFlashDecoderLayer.multi_stream_forward`):
  ge-graph:    torchair.scope.limit_core_num(aic, aiv) nested inside the stream switch, and one
               around the main branch;
  npugraph-ex: torch.npu.npugraph_ex.scope.limit_core_num on both branches;
  eager:       torch.npu.set_stream_limit on the side and the current stream (reset at the join).
Budgets come from --cores (a2, a3, a3-even; see msrewrite/cores.py for their sources) or
--core-limit SIDE_AIC/SIDE_AIV,MAIN_AIC/MAIN_AIV; a budget over the device's cores is refused.

Modes: eager, npugraph-ex, ge-graph. Not cuda: CUDA has no per-stream core limit.
"""

from __future__ import annotations

from msrewrite.cases._base import CoreLimitCase, Invalid


def is_shortcut_moe(callee: str) -> bool:
    # LongCat names the shortcut MoE `mlp` and its dense MLPs `mlps`
    return callee == "mlp"


# Declared examples (tests/test_case_examples.py runs them; docs/cases.md shows them).
# VALID: the shortcut MoE on a side stream, cores split.
VALID = """import torch
from torch import nn


class MoeBlock(nn.Module):
    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.mlp = nn.Linear(hidden, hidden)

    def forward(self, x):
        shared = self.mlp(x)
        weights = torch.softmax(self.gate(x), dim=-1)
        routed = sum(expert(x) * weights[:, i : i + 1] for i, expert in enumerate(self.experts))
        return routed + shared


def make():
    torch.manual_seed(0)
    return MoeBlock().eval(), (torch.randn(3, 16),)
"""
# INVALID: the only main work is inside the join statement, outside any core budget.
INVALID = """import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.attn = nn.Linear(hidden, hidden)
        self.mlp = nn.Linear(hidden, hidden)

    def forward(self, x):
        shortcut = self.mlp(x)
        return self.attn(x) + shortcut
"""


CASE = CoreLimitCase(
    name="attn-moe-limit-core",
    summary="shortcut MoE on a side stream next to attention, with AI cores split between the streams",
    modes=("eager", "npugraph-ex", "ge-graph"),
    is_seed=is_shortcut_moe,
    stream_tag="moe_shortcut",
    flag_name="ENABLE_MOE_SHORTCUT_STREAM",
    what=("the shortcut MoE", "attention and the dense MLPs"),
    notes="not cuda: CUDA has no per-stream core limit",
    order=6,
    golden_examples=("longcat_layer",),
    mutant_modes=("eager",),
    mutant_examples=("longcat_layer",),
    valid=(VALID,),
    invalid=(Invalid(INVALID, "gives the main work between the fork and the join a core budget of its own"),),
)
