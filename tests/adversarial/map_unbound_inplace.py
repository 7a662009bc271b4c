"""Adversarial model: an in-place tensor method handed to map

`map(torch.Tensor.mul_, [x], [2])` calls `x.mul_(2)`.

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "race-(war|raw|waw)|late schedule|interleaved schedule"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self._held = None

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        list(map(torch.Tensor.mul_, [x], [2]))  # leak
        return h + x + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
