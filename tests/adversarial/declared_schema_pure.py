"""Adversarial model: an op defined by a schema string that writes nothing and returns a new tensor

`torch.ops.msr_adv_schema_p.mix(x, w)` is defined by torch.library.define as `(Tensor x, Tensor w)
-> Tensor`: no argument is annotated `(a!)` and the result has no alias annotation, so it reads the
side input x and the shared expert may run beside it.

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "clean"


def _mix(x, w):
    return x * w


if not hasattr(torch.ops.msr_adv_schema_p, "mix"):  # a second load of this file in one process
    torch.library.define("msr_adv_schema_p::mix", "(Tensor x, Tensor w) -> Tensor")
    torch.library.impl("msr_adv_schema_p::mix", "CompositeImplicitAutograd", func=_mix)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = torch.ops.msr_adv_schema_p.mix(x, self.w)
        h = self.gate(h)
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
