"""Adversarial model: a torch.no_grad block after main work holds the side work and its join: fork and join inside it

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

    def forward(self, x):
        h = self.gate(x)
        with torch.no_grad():
            s = self.shared_experts(x)  # side
            y = self.experts(h)
            out = y + s  # join
        return F.silu(out)


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
