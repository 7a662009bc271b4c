"""Adversarial model: each branch has its own BatchNorm: their running statistics are apart (clean)

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = "clean"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(8)
        self.bn2 = nn.BatchNorm1d(8)

    def forward(self, x):
        s = self.shared_experts(self.bn(x))  # side
        h = self.gate(self.bn2(x * 2))
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
