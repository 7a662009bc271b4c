"""Adversarial model: the main path scales the router's weight, which the side work never reads

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = 'clean'


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        s = self.shared_experts(self.norm(x))  # side
        self.gate.weight.data.mul_(0.5)
        h = self.gate(x)
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
