"""Adversarial model: the main path walks self.modules() and rescales every Linear, the shared expert's too

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
        self.register_buffer("bias", torch.full((16,), 0.25))

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        for m in self.modules(): m.weight.data.mul_(0.5) if isinstance(m, nn.Linear) else None  # leak
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
