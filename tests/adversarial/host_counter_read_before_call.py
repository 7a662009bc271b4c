"""Adversarial model: the shared expert counts its calls; the router reads the count before the
call (`# fork`: where a forced plan issues the side work, above that read; apply keeps the fork
below it, which leaves nothing to overlap)

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = "flag on: output 0 differs"  # the early schedule: the side work ran above the read


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.down(F.silu(self.up(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = Shared()
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        self.shared_experts.calls = 0
        h = self.experts(self.gate(x))
        # fork
        h = h * (self.shared_experts.calls + 1)  # leak
        s = self.shared_experts(x)  # side
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
