"""Adversarial model: a helper defined twice; the second, the one that runs, writes the side input

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = 'race-(war|raw|waw)|late schedule|interleaved schedule'


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def scale(self, x):
        return x * 2

    def scale(self, x):  # replaces the one above: this one runs
        return x.mul_(2)

    def forward(self, x):
        s = self.shared_experts(x)  # side
        y = self.scale(x)  # leak
        h = self.gate(y)
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
