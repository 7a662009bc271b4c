"""Adversarial model: the router reads the shared expert's call count before the call, routed
experts run after it: the fork stays below the read

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = "clean"


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
        h = self.gate(x) * (self.shared_experts.calls + 1)
        s = self.shared_experts(x)  # side
        h = self.experts(h)
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
