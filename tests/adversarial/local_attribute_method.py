"""Adversarial model: a method named like a tensor method, on a local bound to an attribute

`acc = self.acc` binds the block's `Acc`, whose `add(x, y)` writes x in place. Read by name,
`acc.add` is `Tensor.add`, which writes nothing; it is `Acc.add`, as `self.acc.add` would be.

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "race-(war|raw|waw)|late schedule|interleaved schedule"


class Acc:
    def __init__(self):
        self.scale = 2.0

    def add(self, x, y):
        x.mul_(self.scale).add_(y)
        return x


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.acc = Acc()

    def forward(self, x):
        s = self.shared_experts(x)  # side
        acc = self.acc
        h = self.gate(x)
        h = acc.add(x, h)  # leak
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
