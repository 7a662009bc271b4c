"""Adversarial model: a method rebinds an attribute the shared expert reads, after the join

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
        self.scale = torch.ones(())

    def forward(self, x):
        return self.down(F.silu(self.up(x))) * self.scale


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = Shared()
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def _rescale_shared(self, h):
        self.shared_experts.scale = h.abs().mean()

    def forward(self, x):
        self.shared_experts.scale = torch.ones(())  # each call starts from 1
        s = self.shared_experts(x)  # side
        h = self.experts(self.gate(x))
        out = h + s  # join
        self._rescale_shared(out)
        return out


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
