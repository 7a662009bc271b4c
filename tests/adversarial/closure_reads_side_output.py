"""Adversarial model: a nested function reads the side output; it is called before the first
direct use of the output

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = "NameError|race-(war|raw|waw)|late schedule|interleaved schedule"
# apply joins before `add_shared(routed)` (its call reads `shared`): the race is the marked plan
FORCE = True


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        shared = self.shared_experts(x)  # side

        def add_shared(t):
            return t + shared

        routed = self.experts(self.gate(x))
        out = add_shared(routed)  # leak
        return out * 2 + shared  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
