"""Adversarial model: `self.scale *= 2` on the main path writes the buffer the side work reads:
the twin of augassign_reads_attribute, where only the right side names the attribute

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "main statement at line"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.experts = nn.Linear(16, 16)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x):
        s = self.shared_experts(x) * self.scale  # side
        h = self.experts(x)
        self.scale *= 2  # leak
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
