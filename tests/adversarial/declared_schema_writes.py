"""Adversarial model: an op defined by a schema string that marks its first argument written

`torch.ops.msr_adv_schema_w.scale_into(x, h)` is defined as `scale_into(Tensor(a!) out, Tensor x)
-> ()` on a torch.library.Library: msrewrite reads the schema (the implementation is registered
separately and never read) and finds the write of x, which the side stream reads.

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "race-(war|raw|waw)|late schedule|interleaved schedule"


def _scale_into(out, x):
    out.mul_(0.5).add_(x)


_LIB = torch.library.Library("msr_adv_schema_w", "FRAGMENT")
if not hasattr(torch.ops.msr_adv_schema_w, "scale_into"):  # a second load of this file in one process
    _LIB.define("scale_into(Tensor(a!) out, Tensor x) -> ()")
    _LIB.impl("scale_into", _scale_into, "CompositeExplicitAutograd")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        torch.ops.msr_adv_schema_w.scale_into.default(x, h)  # leak
        return h + x + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
