"""Adversarial model: the shared expert decays its own weights through self.parameters(); the main path reads one

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = 'race-(war|raw|waw)|late schedule|interleaved schedule'


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        for p in self.parameters():
            p.data.mul_(0.5)
        return y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = Shared()
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        h = F.linear(h, self.shared_experts.lin.weight)  # leak
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
