"""Adversarial model: `h *= self.scale` leaves h on x's storage, so the later `h.add_(1)`, in
the window, writes x while the side stream reads it: apply snapshots x at the fork (--protect
auto) or refuses (--protect none); the marked plan, forced without the snapshot, races

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "race: the result changes"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.experts = nn.Linear(16, 16)
        self.scale = 0.5

    def forward(self, x):
        h = x.view(-1, 16)
        h *= self.scale
        s = self.shared_experts(x)  # side
        y = self.experts(x)
        h.add_(1)  # leak
        return y + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
