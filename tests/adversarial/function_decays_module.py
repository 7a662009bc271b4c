"""Adversarial model: a module-level helper handed the block decays its parameters (m.parameters()) while the side runs with them

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = 'race-(war|raw|waw)|late schedule|interleaved schedule'


def decay(m, rate):
    for p in m.parameters():
        p.data.mul_(rate)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)
        self.register_buffer("bias", torch.full((16,), 0.25))

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        decay(self, 0.5)  # leak
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
